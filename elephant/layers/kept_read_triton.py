"""Part 2 of the two-part kept read (layers/kept_read.py) as one Triton kernel: each query over
its best R of K kept tokens with no (B, H, S, K) score matrix, no top-k and no scatter.

`kept_read.top_kept_read` writes the scores of every query against every kept key (at the
recall setting, 64 lanes x 8 heads x 512 queries x 4,096 kept: 1 GiB in bf16 a layer and chunk),
ranks them with top-k, scatters the R softmax weights back into that matrix and multiplies it by
the values. Here a program holds a block of queries of one lane and head and walks the kept keys
in tiles, scoring each tile again on every walk (a tile's score product is cheap on the tensor
cores; the score matrix's round trips through memory were not):

  walk 1   the highest score of each query among the valid keys, and the lane's count of valid
           keys n (with n <= R every valid key is read, as top-k reads them). And a floor for
           the R-th score: the keys taken in groups of G (K / G >= R), the least of the groups'
           highest scores; each group that holds a valid key has one at or above it, so with R
           such groups, R keys score at least that (else the floor is the lowest score).
  search   the R-th highest score T of each query, exactly, by a search in quarters on the
           scores' bit patterns as ordered integers between the floor and the highest: a walk
           counts the valid keys scoring at least each of the interval's three quarter points,
           which leaves a quarter of it (a half where the points coincide); about 8 walks for
           bf16 / fp16 scores (on integers the search ends on a score that occurs), 16 for
           float32; from the groups' floor, near the top of the scores, fewer. (Halving, one
           count a walk, took twice the walks: 16.95 ms against the dense read's 16.03 on the
           H100, 2026-12-07.)
  read     a last walk reads the keys scoring above T and the first of those scoring T, by key
           order, that make R: an online softmax (as flash attention's), the weights of a tile
           multiplied by its values.

The scores are rounded to q's dtype before they are ranked and softmaxed, as the product in q's
dtype rounds them in `top_kept_read`, so both choose from the same numbers; what they may differ
in is the last bit of a score whose sum was added up in another order, and which of tied keys
is read. Forward only: inference's path (`Attention` takes the two-part read where no graph is
recorded). Requires power-of-two head dims of at least 16 (tl.dot's least).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .triton_env import FLOAT_DTYPES, HAS_TRITON, INTERPRET, is_pow2, tl, triton, triton_op

BLOCK_M = 64   # queries a program
BLOCK_N = 64   # kept keys a tile


def supported(q: Tensor, values: Tensor) -> bool:
    """Whether the kernel takes these inputs: a Triton device (or the interpreter on the CPU),
    a float dtype it ranks, power-of-two head dims of 16 or more."""
    return (HAS_TRITON and (q.is_cuda or INTERPRET) and q.dtype in FLOAT_DTYPES
            and all(is_pow2(d) and d >= 16 for d in (q.shape[-1], values.shape[-1])))


if HAS_TRITON:
    @triton.jit
    def _tile_keys(q, k_ptr, valid_ptr, n0, K, s_kn, HD: tl.constexpr, BN: tl.constexpr,
                   WIDE: tl.constexpr):
        """The scores of the query block q (BM, HD) against the kept keys n0 .. n0 + BN: (the
        scores rounded to q's dtype, as float32; their bit patterns as ordered integers, int32
        or int64 with WIDE; which keys are valid)."""
        n = n0 + tl.arange(0, BN)
        inside = n < K
        k = tl.load(k_ptr + n[:, None] * s_kn + tl.arange(0, HD)[None, :], mask=inside[:, None],
                    other=0.0)
        if WIDE:   # float32 scores as torch's float32 product forms them (no TF32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")                    # (BM, BN)
            bits = s.to(tl.int32, bitcast=True).to(tl.int64)
            key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        else:
            s = tl.dot(q, tl.trans(k)).to(q.dtype)
            bits = s.to(tl.int16, bitcast=True).to(tl.int32)
            key = tl.where(bits < 0, bits ^ 0x7FFF, bits)
        ok = inside & (tl.load(valid_ptr + n, mask=inside, other=0) != 0)
        return s.to(tl.float32), key, ok

    @triton.jit
    def _counts_at_least(q, k_ptr, valid_ptr, K: tl.constexpr, s_kn, t1, t2, t3,
                         HD: tl.constexpr, BN: tl.constexpr, WIDE: tl.constexpr):
        """Each query's counts of valid kept keys scoring at least t1, t2 and t3 (BM,) each
        (ordered integers), in one walk."""
        c1 = tl.zeros([q.shape[0]], dtype=tl.int32)
        c2 = tl.zeros([q.shape[0]], dtype=tl.int32)
        c3 = tl.zeros([q.shape[0]], dtype=tl.int32)
        for n0 in tl.range(0, K, BN):
            _, key, ok = _tile_keys(q, k_ptr, valid_ptr, n0, K, s_kn, HD, BN, WIDE)
            c1 += tl.sum(((key >= t1[:, None]) & ok[None, :]).to(tl.int32), axis=1)
            c2 += tl.sum(((key >= t2[:, None]) & ok[None, :]).to(tl.int32), axis=1)
            c3 += tl.sum(((key >= t3[:, None]) & ok[None, :]).to(tl.int32), axis=1)
        return c1, c2, c3

    @triton.jit
    def _kept_read_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, out_ptr, lse_ptr, H, S, K: tl.constexpr,
                          R, scale,
                          s_qb, s_qh, s_qs, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ab,
                          s_ob, s_oh, s_os, HD: tl.constexpr, DV: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, WIDE: tl.constexpr):
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = pid_m * BM + tl.arange(0, BM)
        q = tl.load(q_ptr + b * s_qb + h * s_qh + rows[:, None] * s_qs + tl.arange(0, HD)[None, :],
                    mask=(rows < S)[:, None], other=0.0)
        k_ptr += b * s_kb + h * s_kh
        v_ptr += b * s_vb + h * s_vh
        valid_ptr += b * s_ab
        kdt = tl.int64 if WIDE else tl.int32
        # walk 1: each query's lowest and highest valid score, the least of its groups' highest
        # (groups of G keys that hold a valid one), the lane's valid keys and such groups
        lo = tl.full([BM], 2 ** 31 - 1, kdt)
        floor = tl.full([BM], 2 ** 31 - 1, kdt)
        hi = tl.full([BM], -2 ** 31, kdt)
        n_valid = tl.full([], 0, tl.int32)
        n_groups = tl.full([], 0, tl.int32)
        for n0 in tl.range(0, K, BN):   # (K a constexpr: the interpreter's range takes no other)
            _, key, ok = _tile_keys(q, k_ptr, valid_ptr, n0, K, s_kn, HD, BN, WIDE)
            lo = tl.minimum(lo, tl.min(tl.where(ok[None, :], key, 2 ** 31 - 1), axis=1))
            high = tl.where(ok[None, :], key, -2 ** 31)
            hi = tl.maximum(hi, tl.max(high, axis=1))
            g_high = tl.max(tl.reshape(high, (BM, BN // G, G)), axis=2)          # (BM, BN / G)
            g_ok = tl.max(tl.reshape(ok.to(tl.int32), (BN // G, G)), axis=1) > 0
            floor = tl.minimum(floor, tl.min(tl.where(g_ok[None, :], g_high, 2 ** 31 - 1), axis=1))
            n_valid += tl.sum(ok.to(tl.int32), axis=0)
            n_groups += tl.sum(g_ok.to(tl.int32), axis=0)
        if n_groups >= R:
            lo = floor
        # search: count(>= lo) >= R > count(>= hi) holds throughout; at the end lo is T, the
        # R-th highest score, and above (= count(>= hi)) the keys scoring over it
        hi = hi + 1
        above = tl.zeros([BM], dtype=tl.int32)
        if n_valid > R:
            # each walk counts at the interval's three quarter points (t2 strictly inside it
            # while hi - lo > 1), so it shrinks to a quarter or, where they coincide, a half
            while tl.max(hi - lo, axis=0) > 1:
                d = hi - lo
                t1, t2, t3 = lo + d // 4, lo + d // 2, lo + (3 * d) // 4
                c1, c2, c3 = _counts_at_least(q, k_ptr, valid_ptr, K, s_kn, t1, t2, t3, HD, BN,
                                              WIDE)
                open_ = d > 1
                # the highest point with R or more keys at or above it becomes lo, the next hi
                new_lo = tl.where(c3 >= R, t3, tl.where(c2 >= R, t2, tl.where(c1 >= R, t1, lo)))
                new_hi = tl.where(c3 >= R, hi, tl.where(c2 >= R, t3, tl.where(c1 >= R, t2, t1)))
                c_hi = tl.where(c3 >= R, above, tl.where(c2 >= R, c3, tl.where(c1 >= R, c2, c1)))
                lo = tl.where(open_, new_lo, lo)
                hi = tl.where(open_, new_hi, hi)
                above = tl.where(open_, c_hi, above)
            need = R - above            # of the keys scoring T, the first `need` by key order
        else:
            lo = tl.full([BM], -2 ** 31, kdt)   # every valid key
            need = tl.zeros([BM], dtype=tl.int32)
        # read: the chosen keys' online softmax and values
        m = tl.full([BM], float("-inf"), tl.float32)
        l_sum = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, DV], dtype=tl.float32)
        ties = tl.zeros([BM], dtype=tl.int32)
        for n0 in tl.range(0, K, BN):
            s, key, ok = _tile_keys(q, k_ptr, valid_ptr, n0, K, s_kn, HD, BN, WIDE)
            tie = ((key == lo[:, None]) & ok[None, :]).to(tl.int32)
            rank = ties[:, None] + tl.cumsum(tie, axis=1) - tie           # ties before, by key
            chosen = ok[None, :] & ((key > lo[:, None]) | ((tie != 0) & (rank < need[:, None])))
            ties += tl.sum(tie, axis=1)
            # float32 whatever `scale` arrives as (inductor's wrapper passes a float as fp64)
            x = tl.where(chosen, (s * scale).to(tl.float32), float("-inf"))
            m_new = tl.maximum(m, tl.max(x, axis=1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)   # no key chosen yet: weight 0
            alpha = tl.exp(m - base)
            p = tl.exp(x - base[:, None])
            n = n0 + tl.arange(0, BN)
            v = tl.load(v_ptr + n[:, None] * s_vn + tl.arange(0, DV)[None, :],
                        mask=(n < K)[:, None], other=0.0)
            if WIDE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v).to(tl.float32)
            acc = acc * alpha[:, None] + pv
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            m = m_new
        none = l_sum == 0.0
        out = tl.where(none[:, None], 0.0, acc / tl.where(none, 1.0, l_sum)[:, None])
        lse = tl.where(none, float("-inf"), m + tl.log(tl.where(none, 1.0, l_sum)))
        keep = rows < S
        tl.store(out_ptr + b * s_ob + h * s_oh + rows[:, None] * s_os + tl.arange(0, DV)[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=keep[:, None])
        tl.store(lse_ptr + bh * S + rows, lse, mask=keep)


@triton_op("elephant::kept_read_fused", mutates_args=())
def _kept_read_op(q: Tensor, keys: Tensor, values: Tensor, valid: Tensor, read: int,
                  scale: float) -> tuple[Tensor, Tensor]:
    B, H, S, hd = q.shape
    K, dv = keys.shape[2], values.shape[-1]
    out = torch.empty(B, H, S, dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    valid = valid.to(torch.int8).contiguous()
    bm, bn = (16, 16) if INTERPRET else (BLOCK_M, BLOCK_N)
    group = 1   # the floor's groups: the most keys, a power of two up to a tile, with K / G >= R
    while group * 2 <= bn and K // (group * 2) >= max(read, 1):
        group *= 2
    if B * H * S:
        torch.library.wrap_triton(_kept_read_kernel)[(triton.cdiv(S, bm), B * H)](
            q, keys, values, valid, out, lse, H, S, K, read, scale,
            q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2), valid.stride(0),
            out.stride(0), out.stride(1), out.stride(2), HD=hd, DV=dv, BM=bm, BN=bn, G=group,
            WIDE=q.dtype == torch.float32, num_warps=1 if INTERPRET else 4)
    return out, lse


def fused_kept_read(q: Tensor, keys: Tensor, values: Tensor, valid: Tensor, read: int,
                    scale: float) -> tuple[Tensor, Tensor]:
    """`kept_read.top_kept_read`'s result (out (B, H, S, dv) in q's dtype, lse (B, H, S) float32,
    -inf where a lane has no valid kept token) by the kernel: q (B, H, S, hd), keys (B, H, K, hd),
    values (B, H, K, dv), valid (B, K) bool; the inputs `supported` takes."""
    if not supported(q, values):
        raise ValueError(f"fused_kept_read: expected q on a Triton device in bf16, fp16 or float32 "
                         f"with power-of-two head dims >= 16, got {q.dtype} {tuple(q.shape)} on "
                         f"{q.device}, values {tuple(values.shape)}")
    return _kept_read_op(q, keys, values, valid, int(read), float(scale))
