"""What the ragged last query tile of FlashAttention-2 costs at the recipe's attention shape.

    python benchmarks/bench_varlen_tile.py [out.json]

A chunk of the wt103-70m recipe has 528 query rows a lane (512 tokens and 16 memory rows), so the
varlen kernel (attention.flash_varlen, tiles of 128 query rows) runs a fifth tile per lane and
head for its last 16 rows, and that tile sees every key of [window | chunk]: the most expensive
one. Timed here: the model's layout (per lane the window's invalid slots, then the queries over
[valid slots | chunk]) against the same call with the last 16 query rows given no keys (four
sequences a lane: no work for them, their output zero), forward alone and forward + backward,
in three turns; and checked: the other rows' output is bitwise the same, the tail's is zero, the
gradients finite. The difference bounds what a separate kernel for the tail rows could save
(it would read every key of the lane again). 32 lanes, 8 heads of 64, window 512, bfloat16.
"""
import json
import math
import sys

import torch

from benchmarks.common import environment
from elephant.layers.attention import flash_varlen, varlen_bounds


def bench(f, n: int = 50) -> float:
    """Microseconds a call of f, the mean of n after 5 warm-up calls."""
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(n):
        f()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1000


def main(out: str | None = None) -> dict:
    torch.manual_seed(0)
    B, H, hd, W, S = 32, 8, 64, 512, 528
    T, L, dev = S % 128, W + S, "cuda"
    q = torch.randn(B * S, H, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
    K = torch.randn(B * L, H, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
    V = torch.randn(B * L, H, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
    nv = torch.full((B,), W, device=dev)
    cu_q, cu_k = varlen_bounds(nv, S, W)
    lane = torch.arange(B, device=dev)
    # four sequences a lane: (0 q, W - nv k), (S - T q, nv + S - T k), (T q, 0 k), (0 q, T k)
    k4 = torch.stack([lane * L, lane * L + W - nv, lane * L + L - T, lane * L + L - T], 1).flatten()
    q4 = torch.stack([lane * S, lane * S, lane * S + S - T, lane * S + S], 1).flatten()
    end = torch.tensor([B], device=dev)
    cu_q4, cu_k4 = torch.cat([q4, end * S]).int(), torch.cat([k4, end * L]).int()
    dout = torch.randn(B * S, H, hd, device=dev, dtype=torch.bfloat16)
    scale = 1 / math.sqrt(hd)

    def fwd_bwd(cq, ck):
        flash_varlen(q, K, V, cq, ck, S, L, scale).backward(dout)

    def fwd(cq, ck):
        with torch.no_grad():
            return flash_varlen(q, K, V, cq, ck, S, L, scale)

    res = {}
    for turn in range(3):
        res[f"fwd_full_{turn}"] = bench(lambda: fwd(cu_q, cu_k))
        res[f"fwd_main_{turn}"] = bench(lambda: fwd(cu_q4, cu_k4))
        res[f"fb_full_{turn}"] = bench(lambda: fwd_bwd(cu_q, cu_k))
        res[f"fb_main_{turn}"] = bench(lambda: fwd_bwd(cu_q4, cu_k4))
    o1, o4 = fwd(cu_q, cu_k).view(B, S, H, hd), fwd(cu_q4, cu_k4).view(B, S, H, hd)
    res["main_rows_maxdiff"] = (o1[:, :S - T] - o4[:, :S - T]).abs().max().item()
    res["tail_rows_absmax"] = o4[:, S - T:].abs().max().item()
    q.grad = K.grad = V.grad = None
    fwd_bwd(cu_q4, cu_k4)
    res["grad_finite"] = bool(torch.isfinite(q.grad).all() and torch.isfinite(K.grad).all())
    res["tail_dq_absmax"] = q.grad.view(B, S, H, hd)[:, S - T:].abs().max().item()
    result = environment() | {"unit": "microseconds a call", "results": res}
    print(json.dumps(result, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(*sys.argv[1:2])
