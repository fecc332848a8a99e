"""The SSD scan and the Mamba-2 mixer: every path timed forward and backward (`ssd`), and the
Mamba block's scan and conv backward against an older checkout's (`mamba-bwd`)."""
from __future__ import annotations

import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import (compiled_registers, cuda_or_exit, load_before, median_ms, timer,
                               write_report)
from elephant.config import ModelConfig
from elephant.layers import conv_triton, ssd, ssd_triton
from elephant.layers.mamba import Mamba2
from elephant.layers.ssd import ssd_chunked

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------- ssd
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


def ssd_bench_arguments(ap) -> None:
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


def ssd_bench(args) -> None:
    """GPU benchmark of the SSD scan and the Mamba-2 mixer: forward and forward+backward, every path.

        python benchmarks/kernels.py ssd                 # CUDA: writes benchmarks/results/ssd_<gpu>.json
        python benchmarks/kernels.py ssd --cpu-smoke     # tiny shapes on CPU (Triton in the interpreter)

    Scan at B16 T2048 H16 P64 N64 (--lanes, --tokens), chunk 64 (--chunks: others beside it), bf16
    x/B/C (dt, A, D, initial state in float32):
    ssd_chunked eager, torch.compile(ssd_chunked), the Triton kernels; causal SDPA at the same shape
    (B16, 16 heads x 64, T2048) for scale. Mixer: Mamba2(d_model 512, expand 2, head 64, d_state 64) on
    (16, 2048, 512) under bf16 autocast, with the reference (eager and compiled) and the Triton path.
    Times are medians over --iters iterations after --warmup, by CUDA events, in ms; peak memory in MiB;
    compiled paths are timed forward+backward only (one compile each). `checks` holds the relative error
    of the Triton path against ssd_chunked at the benchmark shape.
    A path that fails records its error and the script goes on; once --budget seconds have passed the
    remaining paths are skipped (compiles are the slow part), so the whole run stays under 2 minutes."""
    t_begin = time.perf_counter()
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        sys.exit("kernels.py ssd: no CUDA device; use --cpu-smoke to check it on CPU")
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
    inputs = grads = None   # freed (the closures above hold them)
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
    out = write_report(report, "ssd", args.out, smoke, gpu)
    print(json.dumps(checks, indent=2))
    print(f"wrote {out} in {report['total_s']} s")


# --------------------------------------------------------------------------------- mamba-bwd
def mamba_bwd_arguments(ap) -> None:
    ap.add_argument("before_ssd", help="an older ssd_triton.py (git show REV:elephant/layers/ssd_triton.py)")
    ap.add_argument("before_conv", help="an older conv_triton.py")
    ap.add_argument("out", nargs="?", help="result file (none: not written)")


def mamba_bwd(args) -> None:
    """The Mamba block's scan and conv backward at the recipe's chunk, before and after the scan's joint
    gradient: the older modules (the scan's three gradients, the compiled concatenation and SiLU' pass,
    the conv's backward) against this checkout's (the scan writing the three into one tensor, SiLU'
    taken by the conv's kernels as they read it).

        git show 5fc47ff:elephant/layers/ssd_triton.py > /tmp/ssd_before.py
        git show 5fc47ff:elephant/layers/conv_triton.py > /tmp/conv_before.py
        python benchmarks/kernels.py mamba-bwd /tmp/ssd_before.py /tmp/conv_before.py [OUT.json]

    Shape: 32 lanes x 528 tokens, 16 heads of 64, d_state 64, one B/C group, bf16; each form captured
    as a CUDA graph and timed by CUDA events (median of 50 replays after 10), whole and by part; the
    outputs compared (dx, dstate, dw, db, dtail, relative to the older form)."""
    dev = cuda_or_exit("kernels.py mamba-bwd")
    b, l, h, p, g, n, Q, K = 32, 528, 16, 64, 1, 64, 64, 4
    hp, gn = h * p, g * n
    cd = hp + 2 * gn
    torch.manual_seed(0)
    xin = torch.randn(b, l, cd, device=dev, dtype=torch.bfloat16)
    state = torch.randn(b, cd, K - 1, device=dev, dtype=torch.bfloat16)
    w = torch.randn(cd, 1, K, device=dev) * 0.3
    bias = torch.randn(cd, device=dev) * 0.1
    v = conv_triton._conv_silu_op(xin, state, w, bias, None, None, None, False)[0]
    act = F.silu(v)
    x = act[..., :hp].view(b, l, h, p)
    B = act[..., hp:hp + gn].view(b, l, g, n)
    C = act[..., hp + gn:].view(b, l, g, n)
    dt = F.softplus(torch.randn(b, l, h, device=dev) - 3)
    A = -torch.rand(h, device=dev) * 4 - 0.5
    D = torch.randn(h, device=dev)
    init = torch.randn(b, h, p, n, device=dev)
    nc = -(-l // Q)
    cs = F.pad(dt * A, (0, 0, 0, nc * Q - l)).view(b, nc, Q, h).cumsum(2).permute(0, 3, 1, 2).contiguous()
    _, _, states = ssd_triton._fwd(x, dt, cs, None, B, C, D, init, None, Q)
    dy = torch.randn(b, l, h, p, device=dev, dtype=torch.bfloat16)
    dfinal = torch.randn(b, h, p, n, device=dev)
    scan_args = (x, dt, cs, None, B, C, D, init, None, states, dy, dfinal, Q)
    ssd_before = load_before(args.before_ssd, "ssd_triton_before")
    conv_before = load_before(args.before_conv, "conv_triton_before")

    @torch.compile
    def cat_silu(dx, dBC, v):
        gr = torch.cat([dx.view(b, l, hp), dBC[..., 0, :].reshape(b, l, gn).to(torch.bfloat16),
                        dBC[..., 1, :].reshape(b, l, gn).to(torch.bfloat16)], -1).float()
        vf = v.float()
        s = torch.sigmoid(vf)
        return (gr * s * (1 + vf * (1 - s))).to(torch.bfloat16)

    def before():
        o = ssd_before._bwd(*scan_args, summed=False)
        gg = cat_silu(o[0], o[3], v)
        return conv_before._conv_bwd_op(gg, xin, state, w, None, None, None)

    def after():
        o = ssd_triton._bwd(*scan_args, summed=False, joint=True)
        return conv_triton._conv_bwd_op(o[0], xin, state, w, None, None, None, False, v)

    def after_scan():
        return ssd_triton._bwd(*scan_args, summed=False, joint=True)

    def before_scan():
        return ssd_before._bwd(*scan_args, summed=False)

    def after_conv(gj=ssd_triton._bwd(*scan_args, summed=False, joint=True)[0]):
        return conv_triton._conv_bwd_op(gj, xin, state, w, None, None, None, False, v)

    def before_conv(gg=cat_silu(*(lambda o: (o[0], o[3]))(ssd_before._bwd(*scan_args, summed=False)), v)):
        return conv_before._conv_bwd_op(gg, xin, state, w, None, None, None)

    res = {}
    r0, r1 = before(), after()
    res["rel_err"] = [((a.float() - c.float()).abs().max() / c.float().abs().max()).item() for a, c in zip(r1, r0)]
    for name, fn in (("before", before), ("after", after), ("before_scan", before_scan), ("after_scan", after_scan),
                     ("before_conv", before_conv), ("after_conv", after_conv)):
        res[name + "_us"] = median_ms(fn, dev, 50, 10, graph=True) * 1e3
        print(name, round(res[name + "_us"], 1), flush=True)
    res["walk_registers_after"] = compiled_registers(conv_triton._conv_bwd_walk_kernel)
    res["walk_registers_before"] = compiled_registers(conv_before._conv_bwd_walk_kernel)
    print(res)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
