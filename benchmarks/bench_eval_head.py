"""Evaluation's head by row blocks: the per-row NLL of h @ W^T (head._forward_nll, logits made
block by block in bf16 and read once by the loss kernel) over one 64-lane chunk step of the
wt103-70m shape (32,768 rows, D 512, V 50,304), at block sizes from the default (two blocks of
16,384) down to blocks whose bf16 logits would stay in L2 (64-384 rows: 6-39 MB), at three
launches of the NLL kernel; `matmul_only_ms` the blocks' products alone.

    python benchmarks/bench_eval_head.py [--quick] [out.json]      # CUDA

--quick: the blocked pass at its default only (no block or NLL-launch sweep), then the fused head.

The question it answered (session 38): would evaluation's head gain from blocks small enough that
the logits never leave L2 (no trip through memory between the product and the loss kernel)? No:
3.7 ms a pass at the default, 4.3-4.7 ms at 512-1,024 rows and worse below, the products losing
more than the loss kernel gains (docs/RESULTS.md, issue 12, session 38).

Then the head that never writes its logits (elephant/layers/linear_nll_triton.py, head.EVAL_FUSED),
over a sweep of its launch (rows and columns a tile, D a product step, warps, stages; `fused`
rows): against the default blocked pass above, and its largest difference from it.
"""
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import cuda_or_exit, environment, median_ms  # noqa: E402
from elephant.layers import ce_triton, head, linear_nll_triton  # noqa: E402


# the fused head's launches: (rows BM and columns BN a tile, BK of D a product step, warps,
# pipeline stages); session 40 also swept two forms since dropped (the tile loop unflattened:
# 4.59-4.73 ms; the row block's h kept on chip: 4.11-8.47 ms), results/eval_head_{flat,sweep}_2026-11-27T07*
SWEEP = ((128, 128, 64, 8, 3), (128, 128, 64, 8, 2), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
         (128, 128, 32, 8, 4), (128, 128, 32, 8, 6), (256, 64, 64, 8, 3), (128, 256, 32, 8, 4),
         (64, 256, 64, 4, 3), (128, 128, 64, 4, 4))
# programs in flight the vocabulary's split aims for (linear_nll_triton.TARGET_PROGRAMS), swept
# at the fastest launch of SWEEP
TARGETS = (132, 264, 396, 528, 1056)


def main(path: str | None = None, quick: bool = False) -> dict:
    dev = cuda_or_exit("bench_eval_head")
    gen = torch.Generator(device=dev).manual_seed(0)
    N, D, V = 32768, 512, 50304
    h = torch.randn(N, D, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(V, D, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device=dev, generator=gen)
    want = head._forward_nll(h, w, t, 16384)[0]
    exact = torch.cat([torch.logsumexp(z, 1) - z.gather(1, tb[:, None])[:, 0]   # float32 logits
                       for z, tb in ((h[r].float() @ w.float().t(), t[r])
                                     for r in head._blocks(N, 4096))])
    chosen = ce_triton.LAUNCH["nll"]
    rows_out = []
    try:
        for launch in ((chosen,) if quick else ((2048, 4), (4096, 4), (8192, 8))):
            ce_triton.LAUNCH["nll"] = launch
            for rows in ((16384,) if quick else (16384, 4096, 1024, 512, 384, 256, 192, 128, 64)):
                got = head._forward_nll(h, w, t, rows)[0]
                err = float((got - want).abs().max())
                ms = median_ms(lambda: head._forward_nll(h, w, t, rows), dev, 20, 3, graph=True)
                mm = median_ms(lambda: [h[s] @ w.t() for s in head._blocks(N, rows)], dev, 20, 3,
                               graph=True)
                rows_out.append(dict(launch=launch, block_rows=rows, ms=ms, matmul_only_ms=mm,
                                     maxerr=err,
                                     maxerr_vs_float32_logits=float((got - exact).abs().max())))
                print(json.dumps(rows_out[-1]), flush=True)
    finally:
        ce_triton.LAUNCH["nll"] = chosen
    fused = []
    kept = dict(linear_nll_triton.LAUNCH)
    try:
        for bm, bn, bk, warps, stages in SWEEP:
            linear_nll_triton.LAUNCH.update(BM=bm, BN=bn, BK=bk, warps=warps, stages=stages)
            row = dict(BM=bm, BN=bn, BK=bk, warps=warps, stages=stages)
            try:
                got = linear_nll_triton.linear_nll(h, w, t)[0]
                err = float((got - want).abs().max())
                ms = median_ms(lambda: linear_nll_triton.linear_nll(h, w, t), dev, 20, 3, graph=True)
                row.update(ms=ms, maxerr_vs_blocked=err,
                           maxerr_vs_float32_logits=float((got - exact).abs().max()))
            except Exception as e:   # record and go on (a tile may not fit)
                row["error"] = f"{type(e).__name__}: {str(e)[-300:]}"
            fused.append(row)
            print(json.dumps({"fused": row}), flush=True)
        best = min((r for r in fused if "ms" in r), key=lambda r: r["ms"])
        linear_nll_triton.LAUNCH.update({k: best[k] for k in kept})
        target = linear_nll_triton.TARGET_PROGRAMS
        for programs in TARGETS:
            linear_nll_triton.TARGET_PROGRAMS = programs
            row = {**{k: best[k] for k in kept}, "target_programs": programs,
                   "split": linear_nll_triton.split_for(N, V, best["BM"], best["BN"]),
                   "ms": median_ms(lambda: linear_nll_triton.linear_nll(h, w, t), dev, 20, 3,
                                   graph=True)}
            fused.append(row)
            print(json.dumps({"fused": row}), flush=True)
        linear_nll_triton.TARGET_PROGRAMS = target
    finally:
        linear_nll_triton.LAUNCH.update(kept)
    out = {**environment(dev), "command": " ".join(["python benchmarks/bench_eval_head.py"] + sys.argv[1:]),
           "shape": {"rows": N, "d_model": D, "vocab": V}, "rows": rows_out, "fused": fused,
           "fused_launch": kept}
    if path:
        Path(path).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--quick"]
    main(args[0] if args else None, quick="--quick" in sys.argv[1:])
