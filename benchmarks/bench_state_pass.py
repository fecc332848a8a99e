"""The SSD scan's two state kernels (ssd_triton's _states_fwd_kernel and _states_bwd_kernel) over
their launch: rows of P per program, warps and pipeline stages.

    python benchmarks/bench_state_pass.py [--segments] [--before FILE]
                                          # CUDA: benchmarks/results/states_launch[_segments]_<gpu>.json

Each program walks one lane's chunks in order for its rows of one head's (P x N) state: the forward
adds each chunk's own state to the one it carries and writes the state entering every chunk; the
backward carries the state's gradient back from the last chunk and writes the gradient w.r.t. each
chunk's own state. (Until 2026-11-25 these were three kernels each way: chunk_state wrote every
chunk's own state or its gradient, a state pass read them back and wrote the carried ones; their
launch sweep is in LOG.md.) Timed: the scan's whole forward and backward (`_fwd`, `_bwd`: the state
kernel, the chunk scan, the sums), as CUDA graphs, at the recipe's shape of bench_scan_launch.py
(with --segments its packed form), every configuration's outputs checked against the launch
ssd_triton takes now. --before FILE times another copy of the module (e.g. `git show
<rev>:elephant/layers/ssd_triton.py > /tmp/ssd_before.py`) at its own launches beside this one,
in turns: the A/B of a kernel change in one run.
"""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_scan_launch import Problem, close  # noqa: E402
from benchmarks.common import (cuda_or_exit, environment, fastest, load_before,  # noqa: E402
                               median_ms, result_path, sweep_parser)
from elephant.layers import ssd_triton  # noqa: E402


def main() -> None:
    ap = sweep_parser(30, 5, "with document boundaries and the segments' initial state (packed rows)")
    ap.add_argument("--rows", default="16,32,64", help="rows of P per program")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--before", help="another copy of ssd_triton.py, timed beside this one")
    args = ap.parse_args()
    device = cuda_or_exit("bench_state_pass")
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


if __name__ == "__main__":
    main()
