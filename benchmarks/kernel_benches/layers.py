"""The layers' kernels: attention's paths and the fused elephant MLP (`layers`), and the Mamba
block's gated RMSNorm backward over its launch (`gated-norm`)."""
from __future__ import annotations

import datetime
import itertools
import json
import platform
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common import (cuda_or_exit, environment, median_ms, rel_error, result_path,
                               saved_bytes)
from elephant.config import ModelConfig
from elephant.layers import norm_triton
from elephant.layers.attention import attend, attend_flex, attend_reference
from elephant.layers.elephant import ElephantMLP, elephant_glu, elephant_glu_ref

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------ layers
SDPB = torch.nn.attention.SDPBackend


class Bench:
    def __init__(self, device: str, budget_s: float, iters: int, warmup: int):
        self.device, self.budget_s, self.iters, self.warmup = device, budget_s, iters, warmup
        self.start = time.time()
        self.results: dict[str, dict] = {}

    def run(self, group: str, name: str, make, **info):
        """make() -> a closure that runs one forward + backward; record its time and peak memory."""
        entry = dict(info)
        self.results.setdefault(group, {})[name] = entry
        if time.time() - self.start > self.budget_s:
            entry["skipped"] = f"time budget of {self.budget_s:.0f} s spent"
            print(f"{group:18s} {name:28s} skipped (budget)", flush=True)
            return
        t0 = time.time()
        try:
            step = make()
            entry.update(self.measure(step))
        except Exception as e:  # a failing variant is a result, not a crash
            entry["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            entry["traceback_tail"] = traceback.format_exc()[-800:]
        finally:
            step = None
            self.free()
        entry["wall_s"] = round(time.time() - t0, 2)
        shown = entry.get("error") or f"{entry['ms']:.3f} ms, peak {entry.get('peak_mib', 0):.0f} MiB"
        print(f"{group:18s} {name:28s} {shown}", flush=True)

    def measure(self, step) -> dict:
        cuda = self.device == "cuda"
        for _ in range(self.warmup):
            step()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(self.iters)]
            for start, end in events:
                start.record()
                step()
                end.record()
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) for s, e in events]
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            return {"ms": statistics.median(times), "ms_min": min(times), "peak_mib": round(peak, 1)}
        times = []
        for _ in range(self.iters):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
        return {"ms": statistics.median(times), "ms_min": min(times)}

    def free(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------- attention
def attention_step(q, k, v, do, cache=(None, None, None), backend="sdpa", sdpa=None, flex=False):
    ck, cv, valid = cache

    def step():
        if flex:
            o = attend_flex(q, k, v, ck, cv, valid)
        elif backend == "reference":
            o = attend_reference(q, k, v, ck, cv, valid)
        elif sdpa is not None:
            with torch.nn.attention.sdpa_kernel(sdpa):
                o = attend(q, k, v, ck, cv, valid)
        else:
            o = attend(q, k, v, ck, cv, valid)
        torch.autograd.grad(o, (q, k, v), do)
    return step


def bench_attention(bench: Bench, dev: str, smoke: bool):
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    B, H, S, hd = (2, 2, 64, 16) if smoke else (16, 16, 2048, 64)
    qkv = [torch.randn(B, H, S, hd, device=dev, dtype=dt, requires_grad=True) for _ in range(3)]
    do = torch.randn(B, H, S, hd, device=dev, dtype=dt)
    flops = 4 * B * H * S * S / 2 * hd * 3.5  # causal half; backward = 2.5 x forward
    shape = dict(B=B, H=H, S=S, hd=hd, dtype=str(dt), tflop_per_step=flops / 1e12)
    for name, kw in [("sdpa_causal_auto", {}), ("sdpa_causal_flash", dict(sdpa=SDPB.FLASH_ATTENTION)),
                     ("sdpa_causal_cudnn", dict(sdpa=SDPB.CUDNN_ATTENTION)),
                     ("reference_mask", dict(backend="reference"))]:
        bench.run("attention_causal", name, lambda kw=kw: attention_step(*qkv, do, **kw), **shape)
    add_tflops(bench.results["attention_causal"], flops)
    del qkv, do

    B, H, S, W, hd = (2, 2, 24, 32, 16) if smoke else (32, 8, 528, 512, 64)
    qkv = [torch.randn(B, H, S, hd, device=dev, dtype=dt, requires_grad=True) for _ in range(3)]
    do = torch.randn(B, H, S, hd, device=dev, dtype=dt)
    ck, cv = (torch.randn(B, H, W, hd, device=dev, dtype=dt) for _ in range(2))
    filled = torch.full((B,), W, device=dev)
    filled[: B // 4] = torch.randint(0, W, (B // 4,), device=dev)  # lanes after a recent reset
    valid = torch.arange(W, device=dev) >= (W - filled[:, None])    # right-aligned, (B, W)
    cache = (ck, cv, valid)
    keys = valid.float().sum(1).mean().item() + (S + 1) / 2
    flops = 4 * B * H * S * keys * hd * 3.5
    shape = dict(B=B, H=H, S=S, W=W, hd=hd, dtype=str(dt), valid_frac=valid.float().mean().item(),
                 tflop_per_step=flops / 1e12)
    for name, kw in [("sdpa_mask_auto", {}), ("sdpa_mask_efficient", dict(sdpa=SDPB.EFFICIENT_ATTENTION)),
                     ("sdpa_mask_cudnn", dict(sdpa=SDPB.CUDNN_ATTENTION)),
                     ("flex_block_mask", dict(flex=True))]:
        bench.run("attention_cache", name, lambda kw=kw: attention_step(*qkv, do, cache, **kw), **shape)
    add_tflops(bench.results["attention_cache"], flops)


def add_tflops(group: dict, flops: float):
    for entry in group.values():
        if "ms" in entry:
            entry["tflops"] = round(flops / (entry["ms"] * 1e-3) / 1e12, 1)


# ------------------------------------------------------------------------------- MLP
def saved_mib(fn, *args, exclude=()) -> float:
    return round(saved_bytes(fn, *args, exclude=exclude) / 2**20, 2)


def bench_mlp(bench: Bench, dev: str, smoke: bool):
    d_model, d_mlp, lanes, T = (64, 192, 2, 128) if smoke else (512, 1536, 32, 512)
    tokens = lanes * T
    cfg = ModelConfig(d_model=d_model, d_mlp=d_mlp)
    mlp = ElephantMLP(cfg).to(dev)
    params = list(mlp.parameters())
    h = torch.randn(lanes, T, d_model, device=dev, requires_grad=True)
    dy = torch.randn(*h.shape[:-1], d_model, device=dev, dtype=torch.bfloat16)
    shape = dict(d_model=d_model, d_mlp=d_mlp, tokens=tokens, autocast="bf16")
    compile_ok = dev == "cuda"

    def make(fused: bool, compiled: bool):
        def build():
            if compiled and not compile_ok:
                raise RuntimeError("skipped: torch.compile not exercised in --cpu-smoke")
            module = ElephantMLP(cfg, fused=fused).to(dev)
            module.load_state_dict(mlp.state_dict())
            run = torch.compile(module) if compiled else module

            def step():
                with torch.autocast(dev, dtype=torch.bfloat16):
                    y = run(h)
                torch.autograd.grad(y, [h, *module.parameters()], dy)
            return step
        return build

    for fused in (False, True):
        def fwd(x, fused=fused):
            mlp.fused = fused
            with torch.autocast(dev, dtype=torch.bfloat16):
                return mlp(x)
        shape_f = dict(shape, saved_mib_per_forward=saved_mib(fwd, h, exclude=params))
        for compiled in (False, True):
            name = f"{'fused' if fused else 'reference'}_{'compiled' if compiled else 'eager'}"
            bench.run("mlp", name, make(fused, compiled), **shape_f)

    # the elementwise op alone, (tokens, d_mlp) bf16
    u, g = (torch.randn(tokens, d_mlp, device=dev, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    dz = torch.randn(tokens, d_mlp, device=dev, dtype=torch.bfloat16)
    ref_compiled = torch.compile(elephant_glu_ref) if compile_ok else None
    for name, fn in [("glu_reference_eager", elephant_glu_ref), ("glu_fused", elephant_glu),
                     ("glu_reference_compiled", ref_compiled)]:
        def build(fn=fn):
            if fn is None:
                raise RuntimeError("skipped: torch.compile not exercised in --cpu-smoke")
            return lambda: torch.autograd.grad(fn(u, g), (u, g), dz)
        bench.run("glu_elementwise", name, build, shape=[tokens, d_mlp], dtype="bf16")


def layers_environment(dev: str) -> dict:
    """common.environment (which records the commit) with the platform and cuDNN's version."""
    env = {**environment(dev), "platform": platform.platform()}
    if dev == "cuda":
        env["cudnn"] = torch.backends.cudnn.version()
    return env


def layers_arguments(ap) -> None:
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, to check that it runs")
    ap.add_argument("--budget-s", type=float, default=80.0, help="start no variant after this many s")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", type=str, default=None, help="result file (default: results/layers_<gpu>.json)")


def layers(args) -> None:
    """Benchmark of the layer kernels: attention paths and the fused elephant MLP (forward + backward).

        python benchmarks/kernels.py layers               # on a GPU, ~1-2 minutes; writes
                                                        # benchmarks/results/layers_<gpu>.json
        python benchmarks/kernels.py layers --cpu-smoke   # tiny shapes on CPU: checks that it runs

    What it measures (bf16, median of timed iterations, CUDA events; peak = max_memory_allocated
    during the timed iterations above what was allocated before them):
      attention_causal  B16 T2048 H16 hd64, no cache: SDPA is_causal (auto / flash / cuDNN) and the
                        explicit-mask reference, for scale.
      attention_cache   B32 S528 (512 tokens + 16 memory) H8 hd64 over a W512 cache, some lanes
                        partly filled: SDPA with the boolean mask (auto / efficient / cuDNN) vs
                        FlexAttention with a block mask (compiled; block-mask build included).
      mlp               ElephantMLP d_model 512, d_mlp 1536, 32 x 512 tokens under bf16 autocast:
                        reference vs fused (glu_down), eager and torch.compile'd; also the bytes
                        autograd saves per forward (saved_tensors_hooks).
    A variant that fails records its error string; a variant that would start after the time budget
    is recorded as skipped."""
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit("kernels.py layers: no CUDA device; use --cpu-smoke to check it on CPU")
    dev = "cpu" if args.cpu_smoke else "cuda"
    torch.manual_seed(0)
    bench = Bench(dev, args.budget_s, iters=2 if args.cpu_smoke else args.iters,
                  warmup=1 if args.cpu_smoke else 3)
    env = layers_environment(dev)
    for part in (bench_attention, bench_mlp):
        try:
            part(bench, dev, args.cpu_smoke)
        except Exception as e:
            bench.results[part.__name__] = {"error": f"{type(e).__name__}: {str(e)[:400]}",
                                            "traceback_tail": traceback.format_exc()[-800:]}
    report = {"env": env, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "total_s": round(time.time() - bench.start, 1), "results": bench.results}
    tag = "cpu-smoke" if args.cpu_smoke else re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"layers_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {out} in {report['total_s']} s")


# -------------------------------------------------------------------------------- gated-norm
def gated_norm_arguments(ap) -> None:
    ap.add_argument("--rows", default="4,2,8")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--per-sm", default="4,2,8")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)


def gated_norm(args) -> None:
    """The Mamba block's gated RMSNorm backward (layers/norm_triton.py) over its launch, against what
    it replaced: inductor's compiled backward of the same PyTorch ops.

        python benchmarks/kernels.py gated-norm      # CUDA: benchmarks/results/gated_norm_<gpu>.json

    Shape: one chunk step of the wt103-70m recipe, 32 lanes x 528 tokens, 1,024 channels (d_inner),
    bfloat16; z a slice of the in-projection's output (2,192 columns), as the block passes it. Each
    form's forward + backward is captured as a CUDA graph and timed by CUDA events (median of --iters
    replays); the backward alone is the difference from the forward alone. Given as GB/s of the bytes
    the backward must move (read dout, y, z; write dy, dz: 5 x 34.6 MB), and every launch's gradients
    checked against the compiled reference's. The sweep: rows a program takes at once, warps, programs
    per SM (norm_triton.LAUNCH)."""
    device = cuda_or_exit("kernels.py gated-norm")
    B, L, D, width = 32, 528, 1024, 2192
    gen = torch.Generator(device=device).manual_seed(0)
    proj = torch.randn(B, L, width, device=device, generator=gen).to(torch.bfloat16)
    z = proj[..., :D].detach().requires_grad_()
    y = torch.randn(B, L, D, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(D, device=device, generator=gen) * 0.2 + 1).requires_grad_()
    dout = torch.randn(B, L, D, device=device, generator=gen).to(torch.bfloat16)
    eps = 1e-5
    moved = 5 * B * L * D * 2

    def timed(fn) -> tuple[float, list]:
        def fwd():
            with torch.no_grad():
                fn(y, z, w, eps)

        def fwd_bwd():   # the gradients returned, not accumulated into .grad (no extra adds)
            return torch.autograd.grad(fn(y, z, w, eps), (y, z, w), dout)
        t_f = median_ms(fwd, device, args.iters, args.warmup, graph=True)
        t_fb = median_ms(fwd_bwd, device, args.iters, args.warmup, graph=True)
        return t_fb - t_f, [g.clone() for g in fwd_bwd()]

    reference = torch.compile(norm_triton.reference, dynamic=False)
    rows_out = []
    ref_ms, want = timed(reference)
    rows_out.append({"form": "inductor (reference ops)", "bwd_ms": ref_ms,
                     "bwd_gb_s": moved / ref_ms / 1e6})
    print(f"inductor's backward of the reference ops: {ref_ms * 1e3:.1f} us "
          f"({moved / ref_ms / 1e6:.0f} GB/s)", flush=True)
    before = norm_triton.LAUNCH
    for rows, warps, per_sm in itertools.product(*(map(int, a.split(",")) for a in
                                                   (args.rows, args.warps, args.per_sm))):
        norm_triton.LAUNCH = (rows, warps, per_sm)
        torch._dynamo.reset()
        kernel = torch.compile(norm_triton.gated_rmsnorm, dynamic=False)
        row = {"form": "kernel", "rows": rows, "warps": warps, "per_sm": per_sm}
        try:
            ms, got = timed(kernel)
            row.update(bwd_ms=ms, bwd_gb_s=moved / ms / 1e6,
                       rel_error=max(rel_error(a, b) for a, b in zip(got, want)))
        except Exception as e:   # noqa: BLE001 (a launch that does not compile is recorded)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    norm_triton.LAUNCH = before
    best = min((r for r in rows_out if r["form"] == "kernel" and "bwd_ms" in r),
               key=lambda r: r["bwd_ms"], default=None)
    out = {**environment(device),
           "shape": {"lanes": B, "tokens": L, "channels": D, "dtype": "bfloat16"},
           "launch_in_use": list(before), "rows": rows_out, "fastest": best,
           "inductor_bwd_ms": ref_ms}
    path = result_path("gated_norm", False)
    path.write_text(json.dumps(out, indent=1))
    print("fastest:", json.dumps(best), "\nwrote", path)

