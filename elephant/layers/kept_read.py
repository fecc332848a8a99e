"""Each query's read of the kept tokens it scores highest, as one part of a two-part attention
merged by log-sum-exp (model.kv_keep_read < the kept tokens a layer holds).

A query that may read R of K kept tokens attends to [its best R kept | window | chunk]. Written
as one masked attention that needs a per-head, per-query mask (B, H, S, K + W) and scores every
kept key twice (once to choose, once in the kernel): at K = 4,096 that cost the recall recipe's
evaluation two thirds of its speed. Softmax over a union of disjoint key sets is the two parts'
softmaxes weighted by their normalizers, so here:

  part 1  each query over [window | chunk] by the layer's own kernel, which also returns the
          log-sum-exp lse1 (B, H, S) of its scaled scores (`attention.attend_lse`; on the CPU
          the explicit `masked_attention_lse` below, the reference);
  part 2  each query over its own best R kept tokens (`top_kept_read`): all K kept keys scored
          once (one matrix product), the R best by top-k with their scores, a softmax over
          those R, and the values read by a second matrix product; lse2 = the log-sum-exp of
          the R scaled scores (-inf where a lane has no visible kept token);
  merge   out = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2), as weights exp(lse_i - lse) with
          lse = logaddexp(lse1, lse2) (`merge_by_lse`): part 1 always holds the query's own key,
          so lse is finite.

Which tokens are read is the masked path's choice (`attention.kept_top`: the same scores, the
same top-k), so the two agree up to rounding and ties. No autograd through part 1's
log-sum-exp on the GPU kernels: `Attention.forward` takes this path only where no graph is
recorded (inference), the masked one for training.
"""
from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from . import kept_read_triton

# Part 2 scores a block of lanes at a time: at most this many score elements (lanes x H x S x K)
# a block, so that the score matrix (the read's one large tensor, reused for its weights) stays
# bounded: 2^29 is 1 GiB in bf16, two blocks at the recall recipe's 64 x 4 x 544 x 4,096.
KEPT_READ_BLOCK = 2 ** 29
# Part 2's kernel where it runs: "fused" (layers/kept_read_triton.py: the keys walked in tiles,
# the R-th score found by a search over the scores, no score matrix) or "dense" (below). Dense
# by default: on the H100 the fused one was no faster (16.95 against 16.03 ms at 64 lanes x 4,096
# kept reading 128, `kernels.py kept-read`, 2026-12-07), though its peak memory is 33 MiB against
# 3.0 GB.
KERNEL = os.environ.get("ELEPHANT_KEPT_READ", "dense")


def masked_attention_lse(q: Tensor, k: Tensor, v: Tensor, mask: Tensor,
                         scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Attention of q (B, H, S, dk) over k (B, H, n, dk), v (B, H, n, dv) under the boolean mask
    (B or 1, H or 1, S, n), written out, with its log-sum-exp: (out (B, H, S, dv) in v's dtype,
    lse (B, H, S) in float32 or float64). Every query must see a key. `scale`: default
    1 / sqrt(dk), SDPA's. The reference of part 1, and the token step's (few queries). The
    products in the inputs' dtype (in bf16 the scores rounded once, the weights as a flash
    kernel rounds them), the softmax in float32 at least."""
    work = torch.promote_types(q.dtype, torch.float32)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.to(q.dtype).transpose(-1, -2)).to(work) * scale   # (B, H, S, n)
    s = s.masked_fill(~mask, float("-inf"))
    lse = s.logsumexp(-1)                                                  # (B, H, S)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)).to(v.dtype), v)
    return out, lse


def top_kept_read(q: Tensor, keys: Tensor, values: Tensor, valid: Tensor, read: int,
                  scale: float) -> tuple[Tensor, Tensor]:
    """Part 2: every query of q (B, H, S, hd) over the `read` valid kept tokens whose keys it
    scores highest (all valid ones when fewer; ties broken either way), keys (B, H, K, hd) and
    values (B, H, K, dv) of the kept tokens, valid (B, K) bool; scores q.k * scale.
    -> (out (B, H, S, dv) in q's dtype, lse (B, H, S) float32 or float64, -inf where no kept
    token is valid).

    The scores are formed once, in q's dtype (as `kept_top` forms them to choose); the R chosen
    are softmaxed in float32 (or 64). The read itself is a dense matrix product: the score
    matrix, no longer needed, becomes the weights (zero, then the R probabilities scattered
    to their slots) and is multiplied by the K values. Gathering the R values of each query
    instead would write (B, H, S, R, dv), R dv = 8,192 elements a query at R = 128 (twice
    the K = 4,096 of the scores, which are there anyway) and read them back for a product of
    a row by R rows per query; the dense product writes nothing more and runs on the tensor
    cores (2 S K dv flops a head). Lanes are taken in blocks of at most KEPT_READ_BLOCK score
    elements. Ranking by NEG + q.k (below) changes no choice among valid slots."""
    if KERNEL == "fused" and kept_read_triton.supported(q, values):
        return kept_read_triton.fused_kept_read(q, keys, values, valid, read, scale)
    B, H, S, hd = q.shape
    K = keys.shape[2]
    work = torch.promote_types(q.dtype, torch.float32)
    # The validity enters the score product as one more dimension, queries [q, 1, 0 ...] against
    # keys [k, 0 or NEG, 0 ...] (8 more, so that rows stay 16-byte aligned): an invalid slot
    # scores NEG + q.k, and no pass over the (B, H, S, K) scores masks them (a copy of the K
    # keys instead, 1/S of that). NEG is far below any score and far above the dtype's least.
    neg = torch.finfo(q.dtype).min / 4
    one = q.new_zeros(*q.shape[:3], 8)
    one[..., 0] = 1
    qx = torch.cat([q, one], dim=-1)                                          # (B, H, S, hd + 8)
    bias = q.new_zeros(B, K).masked_fill_(~valid, neg)[:, None, :, None].expand(B, H, K, 1)
    kx = torch.cat([keys.to(q.dtype), bias, q.new_zeros(B, H, K, 7)], dim=-1)  # (B, H, K, hd + 8)
    step = max(1, KEPT_READ_BLOCK // max(1, H * S * K))
    outs, lses = [], []
    for b0 in range(0, B, step):
        lanes = slice(b0, b0 + step)
        s = torch.matmul(qx[lanes], kx[lanes].transpose(-1, -2))               # (b, H, S, K)
        top, idx = s.topk(read, dim=-1, sorted=False)                          # (b, H, S, R)
        # a pick of an invalid slot (a lane holding fewer valid than R) weighs nothing
        t = torch.where(top > neg / 2, top.to(work) * scale, float("-inf"))
        lse = t.logsumexp(-1)                                                  # (b, H, S)
        # a lane with no valid kept token: every pick -inf, weight 0 (not exp(-inf + inf))
        p = torch.exp(t - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
        w = s.zero_().scatter_(-1, idx, p.to(s.dtype))                        # (b, H, S, K)
        outs.append(torch.matmul(w, values[lanes].to(s.dtype)))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def merge_by_lse(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tensor:
    """The attention over the union of two disjoint key sets from each part's output (B, H, S, d)
    and log-sum-exp (B, H, S): their outputs weighted by exp(lse_i - logaddexp(lse1, lse2)),
    in float32 (or 64), returned in o1's dtype. lse2 may be -inf (no key), lse1 may not."""
    work = torch.promote_types(o1.dtype, torch.float32)
    lse1, lse2 = lse1.to(work), lse2.to(work)
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = torch.exp(lse1 - lse).unsqueeze(-1), torch.exp(lse2 - lse).unsqueeze(-1)
    return (w1 * o1.to(work) + w2 * o2.to(work)).to(o1.dtype)
