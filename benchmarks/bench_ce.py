"""The loss's per-block math (one block of the recipe's window: 16,384 rows x 50,304 bf16 logits): the
Triton kernel (elephant/layers/ce_triton.py) over its launch (vocabulary elements per step, warps)
against inductor's kernel of the plain functions (head._nll_and_dlogits, _nll_lse compiled), the
form it replaces.

    python benchmarks/bench_ce.py     # CUDA: benchmarks/results/ce_<gpu>.json

Two kinds: `grad` (training: NLL, log-sum-exp and the logits' gradient, two reads of the logits
and one write) and `nll` (evaluation: one read). Each is timed as a CUDA graph (median of --iters
after --warmup), given as GB/s of the bytes it must move at least (grad: the logits read once and
the gradient written; nll: the logits read once), and checked against inductor's results. The
gradient's second walk over a row is swept both ways (`reversed`: from the row's end), with and
without the L2 eviction hints (`hints`: ce_triton.L2_HINTS).
`registers`: the registers and spills of each launch compiled.

(Session 30 tried the gradient from one read, a program holding its row whole in registers, at
8, 16 and 32 warps: 429, 413 and 515 us against the walk's 402, spilling 40, 24 and 36
registers, one program per SM; dropped, see LOG.md.)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import (compiled_registers, cuda_or_exit, environment,  # noqa: E402
                               median_ms, rel_close, result_path, sweep_parser)
from elephant.layers import ce_triton, head  # noqa: E402


def main() -> None:
    ap = sweep_parser(30, 5)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=50304)
    args = ap.parse_args()
    device = cuda_or_exit("bench_ce")
    n, V = args.rows, args.vocab
    gen = torch.Generator(device=device).manual_seed(0)
    z = (torch.randn(n, V, device=device, generator=gen) * 2).to(torch.bfloat16)
    t = torch.randint(0, V, (n,), device=device, generator=gen)
    t[::97] = head.IGNORE_INDEX
    scale = torch.rand(n, device=device, generator=gen)
    logits_bytes = z.numel() * z.element_size()
    least = {"grad": 2 * logits_bytes, "nll": logits_bytes}
    inductor = {"grad": torch.compile(head._nll_and_dlogits), "nll": torch.compile(head._nll_lse)}
    args_of = {"grad": (z, t, scale), "nll": (z, t)}

    def timed(fn):
        return median_ms(fn, device, args.iters, args.warmup, graph=True)

    rows, want = [], {}
    for kind in ("grad", "nll"):
        want[kind] = inductor[kind](*args_of[kind])
        ms = timed(lambda: inductor[kind](*args_of[kind]))
        rows.append({"kind": kind, "kernel": "inductor", "us": ms * 1e3,
                     "gb_s": least[kind] / ms / 1e6})
        print(json.dumps(rows[-1]), flush=True)
    chosen = {**ce_triton.LAUNCH, "grad_reversed": ce_triton.GRAD_REVERSED,
              "l2_hints": ce_triton.L2_HINTS}
    configs = [(kind, block, warps, rev, hints) for kind in ("grad", "nll")
               for rev in ((True, False) if kind == "grad" else (False,))
               for hints in ((True, False) if kind == "grad" else (False,))
               for block in (1024, 2048, 4096, 8192, 16384) for warps in (4, 8, 16)]
    try:
        for kind, block, warps, rev, hints in configs:
            ce_triton.LAUNCH[kind] = (block, warps)
            ce_triton.GRAD_REVERSED = rev
            ce_triton.L2_HINTS = hints
            row = {"kind": kind, "kernel": "triton", "block": block, "warps": warps,
                   **({"reversed": rev, "hints": hints} if kind == "grad" else {})}
            try:
                got = ce_triton.FNS[kind](*args_of[kind])
                row["equal"] = all(rel_close(a, b, 2e-3) for a, b in zip(got, want[kind]))
                ms = timed(lambda: ce_triton.FNS[kind](*args_of[kind]))
                row.update(us=ms * 1e3, gb_s=least[kind] / ms / 1e6)
            except Exception as e:  # record and go on (a launch may not fit)
                row["error"] = f"{type(e).__name__}: {str(e)[-400:]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        ce_triton.LAUNCH.update({k: chosen[k] for k in ce_triton.LAUNCH})
        ce_triton.GRAD_REVERSED = chosen["grad_reversed"]
        ce_triton.L2_HINTS = chosen["l2_hints"]
    best = {k: min((r for r in rows if r["kind"] == k and r["kernel"] == "triton"
                    and r.get("equal")), key=lambda r: r["us"], default=None)
            for k in ("grad", "nll")}
    base = {k: next(r["us"] for r in rows if r["kind"] == k and r["kernel"] == "inductor")
            for k in ("grad", "nll")}
    cmd = " ".join(["python benchmarks/bench_ce.py"] + sys.argv[1:])
    out = {**environment(device), "command": cmd,
           "shape": {"rows": n, "vocab": V, "dtype": "bfloat16"}, "inductor_us": base,
           "best": best, "chosen": chosen, "configs": rows,
           "registers": compiled_registers(ce_triton._ce_kernel)}
    path = result_path("ce", False)
    path.write_text(json.dumps(out, indent=1))
    print("inductor", json.dumps(base))
    print("best", json.dumps(best))
    print("chosen", json.dumps(chosen))
    print("wrote", path)


if __name__ == "__main__":
    main()
