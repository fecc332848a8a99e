"""The Mamba block's depthwise conv kernels (conv_triton): their launch sweep, with and without
document boundaries (`conv-launch`), and the backward's tile kernel against the kernel that walks
its tokens (`conv-walk`)."""
from __future__ import annotations

import itertools
import json

import torch

from benchmarks.common import (cuda_or_exit, environment, fastest, load_before, median_ms,
                               rel_close, rel_error, result_path, sweep_arguments)
from elephant.layers import conv_triton

BEFORE = (32, 128, 4)


def close(a, b) -> bool:
    return rel_close(a, b, 1e-3)


# ------------------------------------------------------------------------------- conv-launch
def conv_launch_arguments(ap) -> None:
    sweep_arguments(ap, 30, 5, "with document boundaries and the segments' tail inputs (packed rows)")
    ap.add_argument("--tokens", default="32,16,64")
    ap.add_argument("--channels", default="128,64,256")
    ap.add_argument("--warps", default="4,2,8")
    ap.add_argument("--before", help="another copy of conv_triton.py, timed beside this one")
    ap.add_argument("--silu", action="store_true",
                    help="the forward with the SiLU written by the same kernel (the Mamba block's form)")
    ap.add_argument("--tile", action="store_true",
                    help="without --segments: the backward's tile kernel, not the walk (BWD_WALK)")
    ap.add_argument("--every", type=float, default=150.0,
                    help="with --segments: a document boundary every ~this many tokens")
    ap.add_argument("--starts", action="store_true",
                    help="with --segments: the starts mended over the plain launch (SEGMENT_FORM "
                         "'starts'), not the boundary tiles recomputed")


def conv_launch(args) -> None:
    """The Mamba block's depthwise conv kernels (conv_triton, forward and backward with the weight and
    bias partial sums) over their launch: tokens and channels per program, warps.

        python benchmarks/kernels.py conv-launch [--segments] [--silu]
            # CUDA: benchmarks/results/conv_launch[_segments][_silu]_<gpu>.json

    Shape: one chunk step of the wt103-70m recipe, 32 lanes x (8 + 512 + 8) tokens, 1,152 conv
    channels (d_inner 1,024 + 2 x d_state 64) read in place from the in-projection's output (2,192
    columns), width 4, bfloat16; with --segments, a document boundary every ~--every tokens (default
    150; packed log-normal documents of median 600 put one every ~1,000 chunk tokens) and the
    segments' tail inputs (the packed path); the sweep is then over the launch of the tiles that hold
    a boundary (sub-tiles of the plain tile: a size that does not divide it is recorded as an error);
    with --starts too, the segments' other form (conv_triton.SEGMENT_FORM "starts": what each start
    changes mended over the plain launch, a program a lane), the sweep over the plain launch, and the
    tile form of the same module timed in turns with it ("now_tiles").
    Each configuration is captured as a CUDA graph (eager
    calls are bound by launching the small sums after the kernels) and timed by CUDA events (median of
    --iters replays after --warmup), given as GB/s of the bytes it must move (forward: read x, write
    out; backward: read x and the output's gradient, write dx), and its outputs checked against those
    of the launch before this benchmark (32 tokens x 128 channels, 4 warps). --before FILE times
    another copy of conv_triton.py (e.g. `git show <rev>:elephant/layers/conv_triton.py >
    /tmp/conv_before.py`) at its own launch beside this one, in turns: the A/B of a kernel change in
    one run (its ops registered under another namespace, so that both can load). --silu: the forward
    as the Mamba block calls it, with the SiLU written beside the output by the same kernel (three
    tensors moved instead of two); a --before copy without that form is timed as its conv then F.silu.
    Without --segments the backward is the kernel that walks its tokens (conv_triton.BWD_WALK: its own
    channels and warps, the sweep's tokens); --tile sweeps the tile kernel instead (`kernels.py
    conv-walk` compares the two)."""
    device = cuda_or_exit("kernels.py conv-launch")
    B, L, C, K, width = 32, 8 + 512 + 8, 1152, 4, 2192
    S = args.segments
    gen = torch.Generator(device=device).manual_seed(0)
    proj = torch.randn(B, L, width, device=device, generator=gen).to(torch.bfloat16)
    x = proj[..., 1024:1024 + C]                          # a slice, as the Mamba block reads it
    state = torch.randn(B, C, K - 1, device=device, generator=gen)
    weight = torch.randn(C, 1, K, device=device, generator=gen) * 0.3
    bias = torch.randn(C, device=device, generator=gen) * 0.1
    g = torch.randn(B, L, C, device=device, generator=gen).to(torch.bfloat16)
    if S:
        seg = (torch.rand(B, L, device=device, generator=gen) < 1 / args.every).int().cumsum(1).int()
        tail = torch.randn(C, K - 1, device=device, generator=gen)
        since = conv_triton.segment_since(seg)
    else:
        seg = since = tail = None
    starts = bool(S and args.starts)

    def mend(mod, on):   # the "starts" form's flag, for a module that has that form
        return (True,) if on and hasattr(mod, "SEGMENT_FORM") else ()

    def fwd(mod=conv_triton, on=starts):
        if not args.silu:
            return mod._conv_op(x, state, weight, bias, seg, since, tail, *mend(mod, on))
        if hasattr(mod, "_conv_silu_op"):
            return mod._conv_silu_op(x, state, weight, bias, seg, since, tail, *mend(mod, on))[1]
        return torch.nn.functional.silu(mod._conv_op(x, state, weight, bias, seg, since, tail))

    def bwd(mod=conv_triton, on=starts):
        return mod._conv_bwd_op(g, x, state, weight, seg, since, tail, *mend(mod, on))

    def timed(fn):   # as a CUDA graph: eagerly, the small sums' launches are what is timed
        return median_ms(fn, device, args.iters, args.warmup, graph=True)

    saved, saved_walk = dict(conv_triton.LAUNCH), conv_triton.BWD_WALK
    moved = x.numel() * 2
    # the launches this form takes (mended at the starts: the plain ones, then the lanes')
    kinds = ("fwd_seg", "bwd_seg") if S and not starts else ("fwd", "bwd")
    try:
        if args.tile:
            conv_triton.BWD_WALK = None
        conv_triton.LAUNCH.update({kind: BEFORE for kind in kinds})
        ref_f, ref_b = fwd(), bwd()
        rows = []
        configs = list(itertools.product(*[[int(v) for v in a.split(",")]
                                           for a in (args.tokens, args.channels, args.warps)]))
        meta = {"segments": S, "silu": args.silu, "tile": args.tile,
                "boundary_every": args.every if S else None, "starts": starts,
                "chosen": saved,
                "configs_asked": len(configs),
                "shape": {"lanes": B, "tokens": L, "channels": C, "width": K, "dtype": "bfloat16"}}
        for bl, bc, warps in configs:
            row = {"tokens": bl, "channels": bc, "warps": warps}
            conv_triton.LAUNCH.update({kind: (bl, bc, warps) for kind in kinds})
            # forward and backward apart: with segments a sub-tile that does not divide the plain
            # tile of one of them is refused by that one only
            for name, fn, ref, n_bytes in (("fwd", fwd, [ref_f], 3 if args.silu else 2),
                                           ("bwd", bwd, ref_b, 3)):
                try:
                    out = fn()
                    row[f"equal_{name}"] = all(close(a, r) for a, r in
                                               zip(out if name == "bwd" else [out], ref))
                    row[f"{name}_us"] = timed(fn) * 1e3
                    row[f"{name}_gb_s"] = n_bytes * moved / row[f"{name}_us"] / 1e3
                except Exception as e:  # record and go on (a configuration may not fit)
                    row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            write(rows, meta, device)   # after each row: a sweep cut off keeps what it measured
    finally:
        conv_triton.LAUNCH.update(saved)
        conv_triton.BWD_WALK = saved_walk
    if args.before or starts:   # at their own launches, in turns: this module (with --starts
        # also its tile form, "now_tiles") and the --before copy (in the form asked, if it has it)
        mods = {"now": (conv_triton, starts)}
        if starts:
            mods["now_tiles"] = (conv_triton, False)
        if args.before:
            mods["before"] = (load_before(args.before, "_conv_before"), starts)
        ab = {name: {"equal_fwd": close(fwd(m, on), ref_f),
                     "equal_bwd": all(close(a, r) for a, r in zip(bwd(m, on), ref_b)),
                     "fwd_us": [], "bwd_us": []} for name, (m, on) in mods.items()}
        for _ in range(3):
            for name, (m, on) in mods.items():
                ab[name]["fwd_us"].append(timed(lambda: fwd(m, on)) * 1e3)
                ab[name]["bwd_us"].append(timed(lambda: bwd(m, on)) * 1e3)
        meta["before_module"] = {"file": args.before, **ab}
        print("a/b", json.dumps(meta["before_module"]), flush=True)
    out = write(rows, meta, device)
    print("before", json.dumps(out["before"]))
    print("best", json.dumps(out["best"]))



def write(rows: list, meta: dict, device) -> dict:
    best = fastest(rows)
    before = {k: next((r[f"{k}_us"] for r in rows if f"{k}_us" in r
                       and (r["tokens"], r["channels"], r["warps"]) == BEFORE), None)
              for k in ("fwd", "bwd")}
    out = {**environment(device), **meta,
           "before": {"launch": BEFORE, **{f"{k}_us": v for k, v in before.items()}},
           "best": best, "configs": rows}
    path = result_path("conv_launch" + ("_segments" if meta["segments"] else "")
                       + ("_silu" if meta.get("silu") else ""), False)
    path.write_text(json.dumps(out, indent=1))
    return out


# --------------------------------------------------------------------------------- conv-walk
def conv_walk_arguments(ap) -> None:
    sweep_arguments(ap, 30, 5)
    ap.add_argument("--tokens", default="64,32")
    ap.add_argument("--walks", default="128x2,128x1,256x2,64x1", help="channels x warps, comma-separated")
    ap.add_argument("--silu", action="store_true", help="the backward of the SiLU form (out read too)")


def conv_walk(args) -> None:
    """The conv's backward of width 4 without segments: its tile kernel against the kernel that walks a
    tile's tokens in order (conv_triton._conv_bwd_walk_kernel), at the recipe's chunk.

        python benchmarks/kernels.py conv-walk [--silu]   # CUDA: benchmarks/results/conv_walk[_silu]_<gpu>.json

    Shape as conv-launch: 32 lanes x 528 tokens, 1,152 channels read in place from the
    in-projection's output (2,192 columns), bf16. The whole backward op (`_conv_bwd_op`: the kernel and
    its partial sums' additions) captured as a CUDA graph and timed by CUDA events (median of --iters
    replays after --warmup), for the tile kernel and for the walk over (tokens a tile, channels,
    warps); each walk's outputs against the tile kernel's (relative norm error: dx, dstate, dw, db).
    --silu: the Mamba block's form, g the gradient of SiLU(out), multiplied by SiLU'(out) by the
    kernels as they read it (out a second (B, L, C) tensor read beside g)."""
    dev = cuda_or_exit("kernels.py conv-walk")
    B, L, C, K, width = 32, 528, 1152, 4, 2192
    gen = torch.Generator(device=dev).manual_seed(0)
    proj = torch.randn(B, L, width, device=dev, generator=gen).to(torch.bfloat16)
    x = proj[..., 1024:1024 + C]
    state = torch.randn(B, C, K - 1, device=dev, generator=gen)
    weight = torch.randn(C, 1, K, device=dev, generator=gen) * 0.3
    g = torch.randn(B, L, C, device=dev, generator=gen).to(torch.bfloat16)
    out = torch.randn(B, L, C, device=dev, generator=gen).to(torch.bfloat16) if args.silu else None

    def bwd():
        return conv_triton._conv_bwd_op(g, x, state, weight, None, None, None, False, out)

    def timed():
        return median_ms(bwd, dev, args.iters, args.warmup, graph=True) * 1e3

    saved_walk, saved_launch = conv_triton.BWD_WALK, dict(conv_triton.LAUNCH)
    res = {**environment(dev), "shape": {"lanes": B, "tokens": L, "channels": C, "width": K},
           "chosen": {"walk": saved_walk, "tokens": saved_launch["bwd"][0]}, "silu": args.silu,
           "walks": []}
    try:
        conv_triton.BWD_WALK = None
        ref = bwd()
        res["tile_us"] = timed()
        print(f"tile kernel {saved_launch['bwd']}: {res['tile_us']:.1f} us", flush=True)
        for bl in (int(v) for v in args.tokens.split(",")):
            conv_triton.LAUNCH["bwd"] = (bl,) + saved_launch["bwd"][1:]
            for spec in args.walks.split(","):
                bc, warps = (int(v) for v in spec.split("x"))
                conv_triton.BWD_WALK = (bc, warps)
                row = {"tokens": bl, "channels": bc, "warps": warps, "us": timed(),
                       "rel_err": [rel_error(a, r) for a, r in zip(bwd(), ref)]}
                res["walks"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        conv_triton.BWD_WALK = saved_walk
        conv_triton.LAUNCH.update(saved_launch)
    path = result_path("conv_walk_silu" if args.silu else "conv_walk", False)
    path.write_text(json.dumps(res, indent=1))
    print("wrote", path)

