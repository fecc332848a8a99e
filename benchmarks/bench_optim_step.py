"""The trainer's optimizer phase on the recipe's own model: clipping plus Optimizers.step (Muon +
Adam), how long the host takes to queue it and how long the GPU takes to run it.

    python benchmarks/bench_optim_step.py                 # CUDA, configs/wt103-70m.toml
    python benchmarks/bench_optim_step.py --cpu-smoke     # configs/tiny.toml on the CPU

The model is built from the config (elephant.model.ElephantLM), its gradients random, the
optimizers from `build_optimizers` as the trainer builds them. Medians over --iters after --warmup:
- `wall_ms`: one phase from an idle GPU to its end (CUDA events), as the step pays it when the
  GPU waits for the host;
- `host_ms`: the host's time to queue one phase, with the GPU kept busy beforehand so no launch
  waits for it (`torch.cuda._sleep`);
- `gpu_ms`: the same phase captured once as a CUDA graph and replayed: its kernels alone;
- `profile`: device ms of one phase by kernel kind and its top kernels.
Rows: `clip+step` (the trainer's eager phase), `step` (the update alone), `graphed_step`
(`Optimizers.graphed_step`: the phase as one CUDA graph replay) and `graphed_step compiled` (the
update compiled by inductor before the capture, as train.compile=graphs runs it; its wall_ms is
the replay's GPU time plus the gradients' packing).
Writes benchmarks/results/optim_step_<gpu>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import environment, median_ms, profile, result_path  # noqa: E402


def host_ms(fn, iters: int, cuda: bool) -> float:
    """Median host time to queue fn() while the GPU is busy (nothing waits on the device)."""
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)          # ~0.1 s of GPU: the queue never drains
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--config", default=None, help="default configs/wt103-70m.toml (tiny.toml with --cpu-smoke)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", choices=("eager", "compiled"), default="eager",
                    help="the phase profiled: clip+step (eager) or graphed_step compiled (the "
                         "trainer's form under train.compile=graphs: its graph's kernels)")
    args = ap.parse_args(argv)
    from elephant.config import load_config
    from elephant.model import ElephantLM
    from elephant.optim import build_optimizers
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        sys.exit("bench_optim_step.py needs CUDA (or --cpu-smoke)")
    device = torch.device("cpu" if smoke else "cuda")
    cuda = device.type == "cuda"
    iters, warmup = (2, 1) if smoke else (args.iters, args.warmup)
    cfg = load_config(args.config or ROOT / ("configs/tiny.toml" if smoke else "configs/wt103-70m.toml"),
                      args.set)
    torch.manual_seed(0)
    model = ElephantLM(cfg.model).to(device)
    opt = build_optimizers(model, cfg.optim)
    grads = [(p, torch.randn_like(p) * 1e-3) for p in model.parameters()]

    def set_grads():
        for p, g in grads:
            p.grad = g

    def phase():
        set_grads()
        opt.set_step(100, 1000)
        if cfg.optim.grad_clip:
            opt.clip_grad_norm_(cfg.optim.grad_clip)
        opt.step()

    def graphed():
        set_grads()
        opt.set_step(100, 1000)
        opt.graphed_step(cfg.optim.grad_clip)

    def graphed_compiled():
        set_grads()
        opt.set_step(100, 1000)
        opt.graphed_step(cfg.optim.grad_clip, None if smoke else "inductor")

    def update_only():
        set_grads()
        opt.step()

    out = {**environment(device), "config": str(args.config or "configs/wt103-70m.toml"),
           "overrides": args.set, "parameters": sum(p.numel() for p in model.parameters()),
           "muon_shapes": {("x".join(map(str, b["shape"]))): len(b["index"]) for b in opt.muon.buckets}
           if opt.muon else {}, "iters": iters, "warmup": warmup, "results": {}}
    res = out["results"]
    for name, fn in (("clip+step", phase), ("step", update_only), ("graphed_step", graphed),
                     ("graphed_step compiled", graphed_compiled)):
        row = res[name] = {}
        row["wall_ms"] = median_ms(fn, device, iters, warmup)
        row["host_ms"] = host_ms(fn, iters, cuda)
        if cuda and not name.startswith("graphed_step"):
            try:
                row["gpu_ms"] = median_ms(fn, device, iters, warmup, graph=True)
            except Exception as e:  # a phase that cannot be captured says why
                row["gpu_ms"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, row, flush=True)
    fn, label = ((phase, "clip+step") if args.profile == "eager"
                 else (graphed_compiled, "graphed_step compiled"))
    top, table, summary = profile(fn, 3, device, label, top=40)
    out["profile"] = {"phase": label, "device_ms": summary["device_ms_per_step"],
                      "by_kind": summary["by_kind"], "top": top}
    path = Path(args.out) if args.out else result_path("optim_step", smoke)
    path.write_text(json.dumps(out, indent=1))
    path.with_name(path.stem + "_profile.txt").write_text(table)
    print(json.dumps({k: out[k] for k in ("results", "muon_shapes")}, indent=1))
    print(json.dumps(out["profile"]["by_kind"], indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
