"""The Mamba block's gated RMSNorm backward (layers/norm_triton.py) over its launch, against what
it replaced: inductor's compiled backward of the same PyTorch ops.

    python benchmarks/bench_gated_norm.py      # CUDA: benchmarks/results/gated_norm_<gpu>.json

Shape: one chunk step of the wt103-70m recipe, 32 lanes x 528 tokens, 1,024 channels (d_inner),
bfloat16; z a slice of the in-projection's output (2,192 columns), as the block passes it. Each
form's forward + backward is captured as a CUDA graph and timed by CUDA events (median of --iters
replays); the backward alone is the difference from the forward alone. Given as GB/s of the bytes
the backward must move (read dout, y, z; write dy, dz: 5 x 34.6 MB), and every launch's gradients
checked against the compiled reference's. The sweep: rows a program takes at once, warps, programs
per SM (norm_triton.LAUNCH).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import (cuda_or_exit, environment, median_ms, rel_error,  # noqa: E402
                               result_path)
from elephant.layers import norm_triton  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="4,2,8")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--per-sm", default="4,2,8")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    device = cuda_or_exit("bench_gated_norm")
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
    out = {**environment(device), "command": " ".join(["python", *sys.argv]),
           "shape": {"lanes": B, "tokens": L, "channels": D, "dtype": "bfloat16"},
           "launch_in_use": list(before), "rows": rows_out, "fastest": best,
           "inductor_bwd_ms": ref_ms}
    path = result_path("gated_norm", False)
    path.write_text(json.dumps(out, indent=1))
    print("fastest:", json.dumps(best), "\nwrote", path)


if __name__ == "__main__":
    main()
