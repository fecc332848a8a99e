"""The whole model's chunk step, reference paths against fast ones (`model`), and the trainer's
optimizer phase on the recipe's model (`optim-step`)."""
from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common import bf16_autocast, environment, median_ms, profile, result_path
from elephant.config import ModelConfig
from elephant.model import ElephantLM

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------- model
def make_config(smoke: bool) -> ModelConfig:
    if smoke:
        return ModelConfig(vocab_size=256, d_model=64, n_heads=4, layers="MAMA", d_mlp=128,
                           d_state=16, mamba_head_dim=32, ssd_chunk=16, n_mem=2, kv_window=32)
    return ModelConfig(vocab_size=50304, d_model=512, n_heads=8, layers="MAMMAMMA", d_mlp=2048,
                       d_state=64, mamba_head_dim=64, ssd_chunk=64, n_mem=8, kv_window=512,
                       tied_embeddings=True)


def measure(model, B, T, device, iters, autocast) -> dict:
    tokens = torch.randint(0, model.cfg.vocab_size, (iters + 3, B, T + 1), device=device)
    state = model.init_state(B, device=device)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for i in range(iters + 3):
        t0 = time.perf_counter()
        with autocast():
            loss, state = model(tokens[i, :, :-1], state, targets=tokens[i, :, 1:])
        loss.backward()
        state = state.detach()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    times.sort()
    med = times[len(times) // 2]
    out = {"median_ms": med * 1e3, "tokens_per_s": B * T / med}
    if device.type == "cuda":
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        flops = model.flops_per_token(T) * B * T / med
        out["tflops"] = flops / 1e12
        out["mfu_vs_989"] = flops / 989e12
    return out


def model_bench_arguments(ap) -> None:
    ap.add_argument("--cpu-smoke", action="store_true")


def model_bench(args) -> None:
    """Forward+backward throughput of the ~70M configuration (d_model 512, 8 layers MAMMAMMA, vocab
    50304, 32 lanes x 512-token chunks, 8 memory tokens, 512-token KV window): the reference paths
    (PyTorch SSD, explicit-mask attention, autograd MLP) against the fast paths (Triton SSD, SDPA,
    fused elephant MLP), eager and with compiled blocks, bf16 autocast.

        python benchmarks/kernels.py model [--cpu-smoke]
    writes benchmarks/results/model_<gpu>.json."""
    smoke = args.cpu_smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    B, T, iters = (2, 32, 2) if smoke else (32, 512, 10)
    cfg = make_config(smoke)
    torch.manual_seed(0)
    model = ElephantLM(cfg).to(device)
    autocast = bf16_autocast(device)
    results = {**environment(device),
               "config": cfg.to_dict(), "lanes": B, "chunk_len": T,
               "parameters": model.num_params(), "flops_per_token": model.flops_per_token(T),
               "paths": {}}
    variants = [("reference", False, False), ("fast", True, False), ("fast+compile", True, True)]
    for name, fast, compiled in variants:
        if compiled and smoke:
            continue
        try:
            model.set_fast_paths(fast)
            if compiled:
                for block in model.blocks:
                    block.compile(dynamic=False)
            results["paths"][name] = measure(model, B, T, device, iters, autocast)
        except Exception as e:  # record and go on with the other paths
            results["paths"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}",
                                      "trace": traceback.format_exc()[-1500:]}
        print(name, json.dumps(results["paths"][name]), flush=True)
    result_path("model", smoke).write_text(json.dumps(results, indent=1))


# -------------------------------------------------------------------------------- optim-step
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


def optim_step_arguments(ap) -> None:
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--config", default=None, help="default configs/wt103-70m.toml (tiny.toml with --cpu-smoke)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", choices=("eager", "compiled"), default="eager",
                    help="the phase profiled: clip+step (eager) or graphed_step compiled (the "
                         "trainer's form under train.compile=graphs: its graph's kernels)")


def optim_step(args) -> int:
    """The trainer's optimizer phase on the recipe's own model: clipping plus Optimizers.step (Muon +
    Adam), how long the host takes to queue it and how long the GPU takes to run it.

        python benchmarks/kernels.py optim-step                 # CUDA, configs/wt103-70m.toml
        python benchmarks/kernels.py optim-step --cpu-smoke     # configs/tiny.toml on the CPU

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
    Writes benchmarks/results/optim_step_<gpu>.json."""
    from elephant.config import load_config
    from elephant.optim import build_optimizers
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        sys.exit("kernels.py optim-step needs CUDA (or --cpu-smoke)")
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

