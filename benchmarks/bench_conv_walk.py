"""The conv's backward of width 4 without segments: its tile kernel against the kernel that walks a
tile's tokens in order (conv_triton._conv_bwd_walk_kernel), at the recipe's chunk.

    python benchmarks/bench_conv_walk.py [--silu]   # CUDA: benchmarks/results/conv_walk[_silu]_<gpu>.json

Shape as bench_conv_launch.py: 32 lanes x 528 tokens, 1,152 channels read in place from the
in-projection's output (2,192 columns), bf16. The whole backward op (`_conv_bwd_op`: the kernel and
its partial sums' additions) captured as a CUDA graph and timed by CUDA events (median of --iters
replays after --warmup), for the tile kernel and for the walk over (tokens a tile, channels,
warps); each walk's outputs against the tile kernel's (relative norm error: dx, dstate, dw, db).
--silu: the Mamba block's form, g the gradient of SiLU(out), multiplied by SiLU'(out) by the
kernels as they read it (out a second (B, L, C) tensor read beside g).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (cuda_or_exit, environment, median_ms, rel_error,  # noqa: E402
                               result_path, sweep_parser)
from elephant.layers import conv_triton as CT  # noqa: E402


def main() -> None:
    ap = sweep_parser(30, 5)
    ap.add_argument("--tokens", default="64,32")
    ap.add_argument("--walks", default="128x2,128x1,256x2,64x1", help="channels x warps, comma-separated")
    ap.add_argument("--silu", action="store_true", help="the backward of the SiLU form (out read too)")
    args = ap.parse_args()
    dev = cuda_or_exit("bench_conv_walk")
    B, L, C, K, width = 32, 528, 1152, 4, 2192
    gen = torch.Generator(device=dev).manual_seed(0)
    proj = torch.randn(B, L, width, device=dev, generator=gen).to(torch.bfloat16)
    x = proj[..., 1024:1024 + C]
    state = torch.randn(B, C, K - 1, device=dev, generator=gen)
    weight = torch.randn(C, 1, K, device=dev, generator=gen) * 0.3
    g = torch.randn(B, L, C, device=dev, generator=gen).to(torch.bfloat16)
    out = torch.randn(B, L, C, device=dev, generator=gen).to(torch.bfloat16) if args.silu else None

    def bwd():
        return CT._conv_bwd_op(g, x, state, weight, None, None, None, False, out)

    def timed():
        return median_ms(bwd, dev, args.iters, args.warmup, graph=True) * 1e3

    saved_walk, saved_launch = CT.BWD_WALK, dict(CT.LAUNCH)
    res = {**environment(dev), "shape": {"lanes": B, "tokens": L, "channels": C, "width": K},
           "chosen": {"walk": saved_walk, "tokens": saved_launch["bwd"][0]}, "silu": args.silu,
           "walks": []}
    try:
        CT.BWD_WALK = None
        ref = bwd()
        res["tile_us"] = timed()
        print(f"tile kernel {saved_launch['bwd']}: {res['tile_us']:.1f} us", flush=True)
        for bl in (int(v) for v in args.tokens.split(",")):
            CT.LAUNCH["bwd"] = (bl,) + saved_launch["bwd"][1:]
            for spec in args.walks.split(","):
                bc, warps = (int(v) for v in spec.split("x"))
                CT.BWD_WALK = (bc, warps)
                row = {"tokens": bl, "channels": bc, "warps": warps, "us": timed(),
                       "rel_err": [rel_error(a, r) for a, r in zip(bwd(), ref)]}
                res["walks"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        CT.BWD_WALK = saved_walk
        CT.LAUNCH.update(saved_launch)
    path = result_path("conv_walk_silu" if args.silu else "conv_walk", False)
    path.write_text(json.dumps(res, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
