"""GPU benchmark of the SSD scan and the Mamba-2 mixer: forward and forward+backward, every path.

    python benchmarks/bench_ssd.py                 # CUDA: writes benchmarks/results/ssd_<gpu>.json
    python benchmarks/bench_ssd.py --cpu-smoke     # tiny shapes on CPU (Triton in the interpreter)

Scan at B16 T2048 H16 P64 N64 (--lanes, --tokens), chunk 64 (--chunks: others beside it), bf16
x/B/C (dt, A, D, initial state in float32):
ssd_chunked eager, torch.compile(ssd_chunked), the Triton kernels; causal SDPA at the same shape
(B16, 16 heads x 64, T2048) for scale. Mixer: Mamba2(d_model 512, expand 2, head 64, d_state 64) on
(16, 2048, 512) under bf16 autocast, with the reference (eager and compiled) and the Triton path.
Times are medians over --iters iterations after --warmup, by CUDA events, in ms; peak memory in MiB;
compiled paths are timed forward+backward only (one compile each). `checks` holds the relative error
of the Triton path against ssd_chunked at the benchmark shape.
A path that fails records its error and the script goes on; once --budget seconds have passed the
remaining paths are skipped (compiles are the slow part), so the whole run stays under 2 minutes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if "--cpu-smoke" in sys.argv:  # must precede the first Triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from elephant.config import ModelConfig  # noqa: E402
from elephant.layers import ssd, ssd_triton  # noqa: E402
from elephant.layers.mamba import Mamba2  # noqa: E402
from elephant.layers.ssd import ssd_chunked  # noqa: E402
from benchmarks.common import timer  # noqa: E402


def measure(step, device, warmup, iters):
    start, stop = timer(device)
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t0 = start()
        step()
        times.append(stop(t0))
    out = {"median_ms": round(statistics.median(times), 4), "min_ms": round(min(times), 4)}
    if device.type == "cuda":
        out["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def scan_inputs(b, l, h, p, n, device, dtype):
    gen = torch.Generator(device=device).manual_seed(0)
    rn = lambda *s: torch.randn(*s, device=device, generator=gen)
    x, B, C = rn(b, l, h, p).to(dtype), rn(b, l, 1, n).to(dtype), rn(b, l, 1, n).to(dtype)
    dt = torch.exp(torch.rand(b, l, h, device=device, generator=gen) * 4.6 - 6.9)
    A = -(1 + 15 * torch.rand(h, device=device, generator=gen))
    D, s0 = rn(h), rn(b, h, p, n)
    inputs = [t.requires_grad_() for t in (x, dt, A, B, C, D, s0)]
    grads = (rn(b, l, h, p).to(dtype), rn(b, h, p, n))
    return inputs, grads


def scan_steps(fn, inputs, grads, chunk):
    def fwd():
        with torch.no_grad():
            fn(*inputs, chunk_size=chunk)

    def fwd_bwd():
        y, final = fn(*inputs, chunk_size=chunk)
        torch.autograd.grad((y, final), inputs, grads)
    return fwd, fwd_bwd


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: checks that it runs")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget", type=float, default=80.0, help="seconds after which paths are skipped")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile paths")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/ssd_<gpu>.json)")
    ap.add_argument("--lanes", type=int, default=16, help="the scan's and mixer's batch (GPU)")
    ap.add_argument("--tokens", type=int, default=2048, help="their sequence length (GPU; the "
                    "recipe's chunk step: --lanes 32 --tokens 528)")
    ap.add_argument("--chunks", default="", help="comma-separated other chunk lengths of the "
                    "Triton scan, timed beside 64 (the same scan, other blocks)")
    args = ap.parse_args()

    t_begin = time.perf_counter()
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        sys.exit("bench_ssd: no CUDA device; use --cpu-smoke to check the script on CPU")
    device = torch.device("cpu" if smoke else "cuda")
    if smoke:
        b, l, h, p, n, chunk, d_model, head, iters, warmup = 1, 40, 2, 16, 16, 16, 32, 16, 2, 1
    else:
        b, l, h, p, n, chunk, d_model, head = args.lanes, args.tokens, 16, 64, 64, 64, 512, 64
        iters, warmup = args.iters, args.warmup
    dtype = torch.float32 if smoke else torch.bfloat16  # the interpreter has no bf16 matmul
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu-smoke"
    results: dict = {}
    checks: dict = {}

    def run(name, make_steps, compiled=False):
        if time.perf_counter() - t_begin > args.budget:
            results[name] = {"skipped": f"time budget of {args.budget:.0f} s spent"}
            print(f"{name:32s} skipped (budget)", flush=True)
            return
        if compiled and args.no_compile:
            results[name] = {"skipped": "--no-compile"}
            return
        entry = {}
        try:
            t0 = time.perf_counter()
            steps = make_steps()
            for kind, step in steps.items():
                entry[kind] = measure(step, device, warmup, iters)
            entry["wall_s"] = round(time.perf_counter() - t0, 1)
        except Exception as e:  # one path failing must not lose the others
            entry["error"] = f"{type(e).__name__}: {e}"[:1000]
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results[name] = entry
        summary = {k: v["median_ms"] for k, v in entry.items() if isinstance(v, dict)}
        print(f"{name:32s} {summary or entry.get('error')}", flush=True)

    # --- the scan ---------------------------------------------------------------------------
    inputs, grads = scan_inputs(b, l, h, p, n, device, dtype)

    def scan_paths(fn, compiled=False):
        def make():
            fwd, fwd_bwd = scan_steps(fn, inputs, grads, chunk)
            # compiled paths: forward+backward only (a forward-only graph would be a second compile)
            return {"fwd_bwd": fwd_bwd} if compiled else {"fwd": fwd, "fwd_bwd": fwd_bwd}
        return make

    run("scan/triton", scan_paths(ssd_triton.ssd_triton))
    for q in (int(c) for c in args.chunks.split(",") if c):
        def other_chunk(q=q):
            fwd, fwd_bwd = scan_steps(ssd_triton.ssd_triton, inputs, grads, q)
            return {"fwd": fwd, "fwd_bwd": fwd_bwd}
        run(f"scan/triton_chunk{q}", other_chunk)
    run("scan/ssd_chunked_eager", scan_paths(ssd_chunked))

    def sdpa():
        q, k, v = (torch.randn(b, h, l, p, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        go = torch.randn(b, h, l, p, device=device, dtype=dtype)

        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(o, (q, k, v), go)
        return {"fwd": fwd, "fwd_bwd": fwd_bwd}
    run("sdpa_causal", sdpa)
    run("scan/ssd_chunked_compiled", scan_paths(torch.compile(ssd_chunked), compiled=True), compiled=True)

    try:  # agreement of the Triton path with the reference at this shape
        y_t, f_t = ssd_triton.ssd_triton(*inputs, chunk_size=chunk)
        g_t = torch.autograd.grad((y_t, f_t), inputs, grads)
        y_r, f_r = ssd_chunked(*inputs, chunk_size=chunk)
        g_r = torch.autograd.grad((y_r, f_r), inputs, grads)
        checks["triton_vs_chunked_rel_err"] = {
            "y": rel_err(y_t, y_r), "final_state": rel_err(f_t, f_r),
            **{"d" + k: rel_err(a, r) for k, a, r in zip(["x", "dt", "A", "B", "C", "D", "s0"], g_t, g_r)}}
    except Exception as e:
        checks["triton_vs_chunked_rel_err"] = {"error": f"{type(e).__name__}: {e}"[:1000]}
    del inputs, grads
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # --- the mixer --------------------------------------------------------------------------
    cfg = ModelConfig(d_model=d_model, expand=2, mamba_head_dim=head, d_state=n, ssd_chunk=chunk)
    torch.manual_seed(0)
    mixer = Mamba2(cfg).to(device)
    x = torch.randn(b, l, d_model, device=device)
    gy = torch.randn(b, l, d_model, device=device, dtype=dtype)
    params = list(mixer.parameters())

    def mixer_path(backend, compiled=False):
        def make():
            fn = torch.compile(mixer) if compiled else mixer

            def forward():
                ssd.set_backend(backend)
                conv, ssm = mixer.init_state(b, device=device, dtype=dtype)
                with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                    return fn(x, conv, ssm)

            def fwd():
                with torch.no_grad():
                    forward()

            def fwd_bwd():
                y, _, _ = forward()
                torch.autograd.grad(y, params, gy.to(y.dtype))
            return {"fwd_bwd": fwd_bwd} if compiled else {"fwd": fwd, "fwd_bwd": fwd_bwd}
        return make

    before = ssd.get_backend()
    try:
        run("mixer/triton", mixer_path("triton"))
        run("mixer/ref_eager", mixer_path("ref"))
        run("mixer/ref_compiled", mixer_path("ref", compiled=True), compiled=True)
        run("mixer/triton_compiled", mixer_path("triton", compiled=True), compiled=True)
    finally:
        ssd.set_backend(before)

    import triton
    report = {
        "benchmark": "ssd",
        "device": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "shape": {"scan": {"B": b, "T": l, "H": h, "P": p, "N": n, "chunk": chunk, "dtype": str(dtype)},
                  "mixer": {"B": b, "T": l, "d_model": d_model, "expand": 2, "head_dim": head,
                            "d_state": n, "autocast": str(dtype) if device.type == "cuda" else "off"}},
        "iters": iters, "warmup": warmup,
        "results_ms": results,
        "checks": checks,
        "total_s": round(time.perf_counter() - t_begin, 1),
    }
    if args.out:
        out = Path(args.out)
    elif smoke:
        out = Path(tempfile.gettempdir()) / "ssd_cpu-smoke.json"
    else:
        out = ROOT / "benchmarks" / "results" / f"ssd_{re.sub(r'[^A-Za-z0-9._-]+', '_', gpu)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(checks, indent=2))
    print(f"wrote {out} in {report['total_s']} s")


if __name__ == "__main__":
    main()
