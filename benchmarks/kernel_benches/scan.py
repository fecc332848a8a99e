"""The SSD scan's Triton kernels over their launch: the chunk scan (`scan-launch`), the two state
kernels (`state-pass`) and the backward's head sum (`group-sum`), each at the recipe's chunk step."""
from __future__ import annotations

import itertools
import json

import torch
import triton

from benchmarks.common import (compiled_registers, cuda_or_exit, environment, fastest,
                               load_before, median_ms, rel_close, result_path, sweep_arguments)
from elephant.layers import ssd_triton

BEFORE = {"fwd": {"num_warps": 4}, "bwd": {"num_warps": 8}}  # the launch before this benchmark


def close(a, b) -> bool:
    return rel_close(a, b, 2e-3)


class Problem:
    """One chunk step's scan at the recipe's shape (see the module docstring), with or without
    document boundaries; `fwd(launch, mod, state_launch)` and `bwd(launch, states, mod,
    state_launch)` run a module's `_fwd` / `_bwd` on it (launch None: the module's own)."""

    def __init__(self, device, segments: bool):
        b, l, h, g, p, n, Q = 32, 8 + 512 + 8, 16, 1, 64, 64, 64
        self.shape = {"lanes": b, "tokens": l, "heads": h, "groups": g, "P": p, "N": n, "chunk": Q,
                      "dtype": "bfloat16"}
        nc = triton.cdiv(l, Q)
        gen = torch.Generator(device=device).manual_seed(0)
        self.x = torch.randn(b, l, h, p, generator=gen, device=device).to(torch.bfloat16)
        self.dt = (torch.rand(b, l, h, generator=gen, device=device) * 0.1 + 0.01)
        A = -torch.rand(h, generator=gen, device=device) - 0.5
        self.B = torch.randn(b, l, g, n, generator=gen, device=device).to(torch.bfloat16) * 0.3
        self.C = torch.randn(b, l, g, n, generator=gen, device=device).to(torch.bfloat16) * 0.3
        self.D = torch.randn(h, device=device, generator=gen)
        self.init = torch.randn(b, h, p, n, device=device, generator=gen) * 0.1
        self.dy = torch.randn(b, l, h, p, generator=gen, device=device).to(torch.bfloat16)
        self.dfinal = torch.randn(b, h, p, n, device=device, generator=gen)
        self.Q = Q
        if segments:
            seg = (torch.rand(b, l, device=device, generator=gen) < 1 / 150).int().cumsum(1).int()
            self.segp = torch.cat([seg, seg[:, -1:].expand(b, nc * Q - l)], dim=1).contiguous()
            self.cs = ssd_triton._segment_cumsum_op((self.dt * A).contiguous(), self.segp, Q)
            self.sinit = torch.randn(h, p, n, device=device, generator=gen) * 0.1
        else:
            self.segp, self.sinit = None, None
            dA = torch.nn.functional.pad(self.dt * A, (0, 0, 0, nc * Q - l)).view(b, nc, Q, h)
            self.cs = dA.cumsum(2).permute(0, 3, 1, 2).contiguous()

    def _args(self):
        return (self.x, self.dt, self.cs, self.segp, self.B, self.C, self.D, self.init, self.sinit)

    def fwd(self, launch=None, mod=ssd_triton, state_launch=None):
        kw = {} if state_launch is None else {"state_launch": state_launch}
        return mod._fwd(*self._args(), self.Q, launch=launch, **kw)

    def bwd(self, launch, states, mod=ssd_triton, state_launch=None):
        kw = {} if state_launch is None else {"state_launch": state_launch}
        return mod._bwd(*self._args(), states, self.dy, self.dfinal, self.Q, launch=launch, **kw)


# ------------------------------------------------------------------------------- scan-launch
def scan_launch_arguments(ap) -> None:
    sweep_arguments(ap, 30, 5, "with document boundaries and the segments' initial state (packed rows)")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="0,1,2", help="0: Triton's default")
    ap.add_argument("--before", help="another copy of ssd_triton.py, timed beside this one")


def scan_launch(args) -> None:
    """The SSD scan's forward and backward (ssd_triton._fwd and _bwd: a state kernel, the chunk scan
    and the sums after them) over the chunk-scan kernels' launch: warps and pipeline stages.

        python benchmarks/kernels.py scan-launch [--segments] [--before FILE]
            # CUDA: benchmarks/results/scan_launch[_segments]_<gpu>.json

    --before FILE times another copy of the module (e.g. `git show <rev>:elephant/layers/ssd_triton.py
    > /tmp/ssd_before.py`) at the launch ssd_triton takes now, beside this one: the A/B of a kernel
    change in one run, its outputs checked equal to this module's.

    (An earlier version of this benchmark, commit e72872f, also swept chunk-scan programs over several
    heads of one B/C group, B, C and C B^T formed once and dB, dC summed in registers: slower at every
    count, so that form was dropped; its results are in LOG.md.) Shape: one chunk step of the
    wt103-70m recipe, 32 lanes x (8 + 512 + 8) tokens, 16 heads of 64 in one group, d_state 64, chunks
    of 64, bfloat16; with --segments, a document boundary every ~150 tokens and the segments' initial
    state (the packed path's kernels). Each configuration is timed as a CUDA graph (median of --iters
    replays after --warmup; until 2026-11-25 eagerly, which timed the host's launches of the small
    sums too) and its every output checked against those of the launch before this benchmark
    (forward 4 warps, backward 8); `chosen` is the launch ssd_triton takes now. `registers`: the
    registers and spills of every chunk-scan kernel compiled (2026-11-26: the backward spilled 88
    registers at 4 warps, and reordered to hold fewer float32 tiles at once, none)."""
    device = cuda_or_exit("kernels.py scan-launch")
    S = args.segments
    prob = Problem(device, S)
    fwd, bwd = prob.fwd, prob.bwd   # (launch, [states,] module)

    def timed(fn):
        return median_ms(fn, device, args.iters, args.warmup, graph=True)

    ref_f = fwd(BEFORE["fwd"])
    ref_b = bwd(BEFORE["bwd"], ref_f[2])
    rows = []
    configs = itertools.product([int(v) for v in args.warps.split(",")],
                                [int(v) for v in args.stages.split(",")])
    for warps, stages in configs:
        launch = {"num_warps": warps, **({"num_stages": stages} if stages else {})}
        row = {"warps": warps, "stages": stages or "default"}
        try:
            got_f = fwd(launch)
            got_b = bwd(launch, ref_f[2])
            row["equal_fwd"] = all(close(a, r) for a, r in zip(got_f, ref_f))
            row["equal_bwd"] = all(close(a, r) for a, r in zip(got_b, ref_b))
            row["fwd_us"] = timed(lambda: fwd(launch)) * 1e3
            row["bwd_us"] = timed(lambda: bwd(launch, ref_f[2])) * 1e3
        except Exception as e:  # record and go on (a configuration may not fit)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    ab = None
    if args.before:  # the other module at today's launch, beside this one, in turns
        before_mod = load_before(args.before, "_ssd_before")
        ab = {"file": args.before, "now": {}, "before": {}}
        for k in ("fwd", "bwd"):
            launch = ssd_triton._scan_launch(k == "bwd", S, False)
            fns = {name: (lambda m=mod: fwd(launch, m)) if k == "fwd" else
                   (lambda m=mod: bwd(launch, ref_f[2], m))
                   for name, mod in (("now", ssd_triton), ("before", before_mod))}
            for name, fn in fns.items():
                ab[name][f"equal_{k}"] = all(close(a, r) for a, r in
                                             zip(fn(), ref_f if k == "fwd" else ref_b))
                ab[name][f"{k}_us"] = []
            for _ in range(3):
                for name, fn in fns.items():
                    ab[name][f"{k}_us"].append(timed(fn) * 1e3)
        print("a/b", json.dumps(ab), flush=True)
    best = fastest(rows)
    before = {k: next((r[f"{k}_us"] for r in rows if "error" not in r
                       if (r["warps"], r["stages"]) == (BEFORE[k]["num_warps"], "default")), None)
              for k in ("fwd", "bwd")}
    chosen = {k: ssd_triton._scan_launch(k == "bwd", S, False) for k in ("fwd", "bwd")}
    out = {**environment(device), "segments": S,
           "shape": prob.shape,
           "before": {k: {"launch": BEFORE[k], "us": before[k]} for k in before},
           "best": best, "chosen": chosen, "configs": rows, "before_module": ab,
           # every launch of the chunk-scan kernels compiled above, this module's
           "registers": {name: compiled_registers(getattr(ssd_triton, name))
                         for name in ("_chunk_scan_fwd_kernel", "_chunk_scan_bwd_kernel")}}
    path = result_path("scan_launch_segments" if S else "scan_launch", False)
    path.write_text(json.dumps(out, indent=1))
    print("before", json.dumps(out["before"]))
    print("best", json.dumps(best))
    print("chosen", json.dumps(chosen))
    print("registers", json.dumps(out["registers"]))
    print("wrote", path)


# -------------------------------------------------------------------------------- state-pass
def state_pass_arguments(ap) -> None:
    sweep_arguments(ap, 30, 5, "with document boundaries and the segments' initial state (packed rows)")
    ap.add_argument("--rows", default="16,32,64", help="rows of P per program")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--before", help="another copy of ssd_triton.py, timed beside this one")


def state_pass(args) -> None:
    """The SSD scan's two state kernels (ssd_triton's _states_fwd_kernel and _states_bwd_kernel) over
    their launch: rows of P per program, warps and pipeline stages.

        python benchmarks/kernels.py state-pass [--segments] [--before FILE]
                                              # CUDA: benchmarks/results/states_launch[_segments]_<gpu>.json

    Each program walks one lane's chunks in order for its rows of one head's (P x N) state: the forward
    adds each chunk's own state to the one it carries and writes the state entering every chunk; the
    backward carries the state's gradient back from the last chunk and writes the gradient w.r.t. each
    chunk's own state. (Until 2026-11-25 these were three kernels each way: chunk_state wrote every
    chunk's own state or its gradient, a state pass read them back and wrote the carried ones; their
    launch sweep is in LOG.md.) Timed: the scan's whole forward and backward (`_fwd`, `_bwd`: the state
    kernel, the chunk scan, the sums), as CUDA graphs, at the recipe's shape of scan-launch
    (with --segments its packed form), every configuration's outputs checked against the launch
    ssd_triton takes now. --before FILE times another copy of the module (e.g. `git show
    <rev>:elephant/layers/ssd_triton.py > /tmp/ssd_before.py`) at its own launches beside this one,
    in turns: the A/B of a kernel change in one run."""
    device = cuda_or_exit("kernels.py state-pass")
    prob = Problem(device, args.segments)
    p = prob.shape["P"]
    chosen = {k: ssd_triton._states_launch(p, backward=k == "bwd") for k in ("fwd", "bwd")}
    ref_f = prob.fwd(state_launch=chosen["fwd"])
    ref_b = prob.bwd(None, ref_f[2], state_launch=chosen["bwd"])

    def timed(fn):
        return median_ms(fn, device, args.iters, args.warmup, graph=True) * 1e3

    rows = []
    for r, w, st in itertools.product(*([int(v) for v in a.split(",")]
                                        for a in (args.rows, args.warps, args.stages))):
        launch = (r, w, st)
        row = {"rows": r, "warps": w, "stages": st}
        try:
            row["equal_fwd"] = all(close(a, b) for a, b in zip(prob.fwd(state_launch=launch), ref_f))
            row["equal_bwd"] = all(close(a, b) for a, b in
                                   zip(prob.bwd(None, ref_f[2], state_launch=launch), ref_b))
            row["fwd_us"] = timed(lambda: prob.fwd(state_launch=launch))
            row["bwd_us"] = timed(lambda: prob.bwd(None, ref_f[2], state_launch=launch))
        except Exception as e:  # record and go on (a configuration may not fit)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    ab = None
    if args.before:  # both modules at their own launches, in turns
        mods = {"now": ssd_triton, "before": load_before(args.before, "_ssd_before")}
        ab = {"file": args.before, **{name: {} for name in mods}}
        states = {}
        for name, mod in mods.items():
            out_f = prob.fwd(None, mod)
            states[name] = out_f[2]
            ab[name]["equal_fwd"] = all(close(a, b) for a, b in zip(out_f, ref_f))
            ab[name]["equal_bwd"] = all(close(a, b) for a, b in
                                        zip(prob.bwd(None, states[name], mod), ref_b))
            ab[name].update(fwd_us=[], bwd_us=[])
        for _ in range(3):
            for name, mod in mods.items():
                ab[name]["fwd_us"].append(timed(lambda: prob.fwd(None, mod)))
                ab[name]["bwd_us"].append(timed(lambda: prob.bwd(None, states[name], mod)))
        print("a/b", json.dumps(ab), flush=True)
    best = fastest(rows)
    out = {**environment(device), "segments": args.segments, "shape": prob.shape,
           "chosen": chosen, "best": best, "configs": rows, "before_module": ab}
    path = result_path("states_launch_segments" if args.segments else "states_launch", False)
    path.write_text(json.dumps(out, indent=1))
    print("best", json.dumps(best))
    print("chosen", json.dumps(chosen))
    print("wrote", path)


# --------------------------------------------------------------------------------- group-sum
def group_sum_arguments(ap) -> None:
    sweep_arguments(ap, 100, 10)
    ap.add_argument("--tokens", type=int, default=16896)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--width", type=int, default=128, help="dB and dC side by side: 2 x d_state")


def group_sum(args) -> None:
    """The scan backward's head sum (ssd_triton.group_sum: dB and dC per head summed over each B/C
    group's heads, one launch for both) at the recipe's shape, timed over its launch choices beside the
    two torch sums it replaced.

        python benchmarks/kernels.py group-sum [--tokens 16896] [--heads 16] [--width 128]

    The recipe (wt103-70m: 32 lanes x (512 + 16 memory slots), 16 heads, dB and dC of 64 each) gives
    16,896 tokens of 16 x 128 bf16. Writes benchmarks/results/group_sum_<gpu>.json: microseconds a call
    and the read bandwidth for each (tokens a program, warps), and the torch sums'."""
    device = cuda_or_exit("kernels.py group-sum")
    src = torch.randn(args.tokens, args.heads, args.width, device=device).bfloat16()
    want = src.float().sum(1, keepdim=True)
    half = args.width // 2
    res = {**environment(device), "shape": [args.tokens, args.heads, args.width], "launches": []}

    def timed(fn):
        return median_ms(fn, device, args.iters, args.warmup, graph=True) * 1e3
    res["torch_two_sums_us"] = timed(lambda: (src[..., :half].sum(1, dtype=torch.float32),
                                              src[..., half:].sum(1, dtype=torch.float32)))
    res["group_sum_us"] = timed(lambda: ssd_triton.group_sum(src, 1))
    out = torch.empty(args.tokens, 1, args.width, device=device)
    BW = triton.next_power_of_2(args.width)
    for bt in (4, 8, 16, 32):
        for warps in (2, 4, 8):
            def fn():
                ssd_triton._group_sum_kernel[(triton.cdiv(args.tokens, bt), 1)](
                    src, out, args.tokens, args.heads, args.width, 0, args.heads, BT=bt, BW=BW,
                    JOINT=False, num_warps=warps)
            us = timed(fn)
            assert torch.allclose(out, want, rtol=1e-4, atol=1e-3)
            res["launches"].append({"tokens": bt, "warps": warps, "us": us,
                                    "read_tb_s": src.numel() * 2 / us / 1e6})
            print(f"{bt:3d} tokens, {warps} warps: {us:6.1f} us", flush=True)
    print(f"group_sum (its launch): {res['group_sum_us']:.1f} us; torch, two sums: "
          f"{res['torch_two_sums_us']:.1f} us")
    path = result_path("group_sum", False)
    path.write_text(json.dumps(res, indent=1))
    print("wrote", path)

