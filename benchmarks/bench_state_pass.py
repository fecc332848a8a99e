"""The SSD scan's two state passes alone (ssd_triton's _state_pass_fwd_kernel and
_state_pass_bwd_kernel), over launch configurations: how far from streaming their memory they run.

    python benchmarks/bench_state_pass.py [--segments] [--before FILE]
                                              # CUDA: benchmarks/results/state_pass_<gpu>.json

The passes walk a lane's chunks in order (the state entering chunk c needs chunk c - 1's), so each
program loops over the chunks of one (lane, head) block of the (P x N) state. Shape: one chunk step
of the wt103-70m recipe, 32 lanes x (8 + 512 + 8) tokens, 16 heads, P = N = 64, chunks of 64 tokens
(9 chunks); with --segments, a document boundary every ~150 tokens and the segments' initial
state (the packed path's kernels). Each configuration (elements per program, warps) is timed as
a CUDA graph (median of --iters replays after --warmup; until 2026-11-25 eagerly, with the host's
launches in the time: session 16's sweep moved by 10-40% from the one before) and given as GB/s
of the float32 states it must read and write (forward: read and write the states; backward: read
the gradients and the states, write the gradients). The results are checked equal to those of
the launch used before (1024 x 4 warps). --before FILE times another copy of the module (e.g.
`git show <rev>:elephant/layers/ssd_triton.py > /tmp/ssd_before.py`) beside this one, each at the
launch its own `_state_pass_launch` picks, in turns: the A/B of a kernel change in one run.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import (cuda_or_exit, environment, median_ms, result_path,  # noqa: E402
                               sweep_parser)
from elephant.layers import ssd_triton  # noqa: E402


def main() -> None:
    ap = sweep_parser(50, 10, "with document boundaries and the segments' initial state (packed rows)")
    ap.add_argument("--before", help="another copy of ssd_triton.py, timed beside this one")
    args = ap.parse_args()
    device = cuda_or_exit("bench_state_pass")
    b, h, p, n, Q = 32, 16, 64, 64, 64
    nc = triton.cdiv(8 + 512 + 8, Q)
    pn = p * n
    gen = torch.Generator(device=device).manual_seed(0)
    own = torch.randn(b, nc, h, pn, device=device, generator=gen) * 0.1
    cs = -torch.rand(b, h, nc, Q, device=device, generator=gen).cumsum(-1) * 0.01
    init = torch.randn(b, h, pn, device=device, generator=gen) * 0.1
    dfinal = torch.randn(b, h, pn, device=device, generator=gen)
    from_y = torch.randn(b, nc, h, pn, device=device, generator=gen)
    state_bytes = own.numel() * 4

    # --segments: packed documents, a boundary every ~150 tokens, and the segments' initial state
    seg = (torch.rand(b, nc * Q, device=device, generator=gen) < 1 / 150).int().cumsum(1).int()
    sinit = torch.randn(h, pn, device=device, generator=gen) * 0.1
    dnew = torch.randn(b, nc, h, pn, device=device, generator=gen)
    S = args.segments

    def fwd(block, warps, mod=ssd_triton):
        states, final = own.clone(), torch.empty_like(init)
        mod._state_pass_fwd_kernel[(triton.cdiv(pn, block), b, h)](
            states, init, sinit if S else final, final, cs, seg if S else cs, h, nc, pn, Q=Q,
            BLOCK=block, HAS_INIT=True, HAS_SEG=S, HAS_SINIT=S, num_warps=warps)
        return states, final

    def bwd(block, warps, states, mod=ssd_triton):
        nblk = triton.cdiv(pn, block)
        dstates = from_y.clone()
        dcs_end = torch.empty(b, h, nc, nblk, device=device)
        dinit = torch.empty_like(init)
        dsinit = torch.empty_like(init)
        mod._state_pass_bwd_kernel[(nblk, b, h)](
            dstates, states, dfinal, dinit, dcs_end, cs, seg if S else cs,
            sinit if S else dcs_end, dnew if S else dcs_end, dsinit if S else dcs_end,
            h, nc, pn, nblk, Q=Q, BLOCK=block, HAS_INIT=True, HAS_SEG=S, HAS_SINIT=S,
            num_warps=warps)
        return dstates, dinit, dcs_end.sum(-1), *((dsinit,) if S else ())

    def timed(fn):
        return median_ms(fn, device, args.iters, args.warmup, graph=True)

    # the clone each call makes is timed apart and taken off
    clone_ms = timed(lambda: own.clone())
    ref_states, ref_final = fwd(1024, 4)   # the configuration before this benchmark
    ref_b = bwd(1024, 4, ref_states)
    rows = []
    for block in (256, 512, 1024, 2048, 4096):
        for warps in (1, 2, 4, 8, 16):
            if block // (32 * warps) < 1:
                continue
            try:
                states, final = fwd(block, warps)
                got_b = bwd(block, warps, states)
                same = (torch.allclose(states, ref_states) and torch.allclose(final, ref_final)
                        and all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(got_b, ref_b)))
                f_ms = max(timed(lambda: fwd(block, warps)) - clone_ms, 1e-6)
                b_ms = max(timed(lambda: bwd(block, warps, ref_states)) - clone_ms, 1e-6)
                rows.append({"block": block, "warps": warps, "fwd_us": f_ms * 1e3, "bwd_us": b_ms * 1e3,
                             "fwd_gb_s": 2 * state_bytes / f_ms / 1e6,
                             "bwd_gb_s": 3 * state_bytes / b_ms / 1e6, "equal": same})
            except Exception as e:  # record and go on
                rows.append({"block": block, "warps": warps, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(json.dumps(rows[-1]), flush=True)
    ab = None
    if args.before:  # the other module at its own launch, beside this one, in turns
        spec = importlib.util.spec_from_file_location("ssd_triton_before", args.before)
        before_mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before_mod)
        mods = {"now": ssd_triton, "before": before_mod}
        launch = {name: {k: mod._state_pass_launch(pn, backward=k == "bwd", has_seg=S)
                         for k in ("fwd", "bwd")} for name, mod in mods.items()}
        outs = {name: bwd(*launch[name]["bwd"], ref_states, mod) for name, mod in mods.items()}
        ab = {"file": args.before, "launch": launch, "equal": all(
            torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(outs["now"], outs["before"])),
              "us": {name: {"fwd": [], "bwd": []} for name in mods}}
        for _ in range(3):
            for name, mod in mods.items():
                ab["us"][name]["fwd"].append(
                    (timed(lambda: fwd(*launch[name]["fwd"], mod)) - clone_ms) * 1e3)
                ab["us"][name]["bwd"].append(
                    (timed(lambda: bwd(*launch[name]["bwd"], ref_states, mod)) - clone_ms) * 1e3)
        print("A/B", json.dumps(ab), flush=True)
    out = {**environment(device),
           "command": "python benchmarks/bench_state_pass.py" + (" --segments" if S else "")
           + (f" --before {args.before}" if args.before else ""),
           "segments": S,
           "shape": {"lanes": b, "heads": h, "P": p, "N": n, "chunk": Q, "chunks": nc},
           "state_mb": state_bytes / 2**20, "clone_us": clone_ms * 1e3, "configs": rows,
           "before": {"block": 1024, "warps": 4}, "before_module": ab}
    path = result_path("state_pass_segments" if S else "state_pass", False)
    path.write_text(json.dumps(out, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
