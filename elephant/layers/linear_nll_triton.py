"""Evaluation's head as one Triton kernel: per-row NLL and log-sum-exp of h @ W^T, logits never
written.

    linear_nll(h (n, D), weight (V, D), targets (n,)) -> (nll (n,), lse (n,))     float32

The same contract as head._forward_nll (the blocked path evaluation runs today, and what the tests
hold this to): zero NLL for an ignored target (-100), no logit read for a target outside [0, V).

Why: in evaluation the blocked head makes each block's logits in bf16 (3.3 GB for one 64-lane
chunk step of the 70M recipe) and ce_triton's NLL kernel reads them back once. On an H100 that is
~3.7 ms of a ~14.5 ms step: the product ~2.8 ms, the NLL's read ~0.9 ms, and the product's write of
the logits inside the first. The 64-lane pass runs at the GPU's power limit, so bytes not moved
are time saved (docs/RESULTS.md, issue 12, 2026-11-27).

How: a program holds BM rows of h and walks its part of the vocabulary in tiles of BN columns.
For each tile it forms the logits in registers (products over D in steps of BK, float32
accumulation) and folds them into an online log-sum-exp in base 2 (running maximum, rescaled
sum). The two loops (tiles, and D within a tile) are flattened into one (`tl.range(flatten=
True)`), so the compiler keeps the next tile's loads in flight while a tile's sums are made: with
the tile loop outside the pipelined D loop (the first form) every tile drained and refilled the
pipeline, 4.59 ms a pass against 3.30 flattened. The vocabulary is split over `split` programs a
row block, so that enough programs are in flight for a short batch; their partial (maximum, sum)
are combined by a few small torch ops. The target's logit is one dot product a row
(_picked_kernel), not a compare and sum over every logit. The logits are float32 sums of the
matmul dtype's products, never rounded to bf16 as the blocked path's are: the two agree to that
rounding, and this one is the closer to the float32 logits (4e-6 against 1.5e-2 at most, H100).

Status: on by default on CUDA (head.EVAL_FUSED): 3.30 ms a 32,768-row pass at its best launch
(128 x 128 tiles, products of 64, 8 warps, 3 stages) against the blocked path's 3.74, on the 64-
lane chunk step 1-2% of its time (`benchmarks/kernels.py eval-head`, `eval-step`). Tried
and dropped (2026-11-27): the row block's h kept on chip and the weight streamed in (BN, D)
tiles, 4.1-8.5 ms (the shared memory it takes leaves one program an SM and few stages). What
would make it GEMM-grade: TMA loads and warp specialization (loads, products and the
log-sum-exp step in warps of their own), beyond what Triton's loops give.

Registered with torch.library.triton_op (inductor launches it from a compiled chunk). Runs on
CUDA, and on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .ce_triton import IGNORE_INDEX
from .triton_env import FLOAT_DTYPES as _DTYPES
from .triton_env import HAS_TRITON, tl, triton
from .triton_env import INTERPRET as _INTERPRET
from .triton_env import check, triton_op

# (BM rows, BN vocabulary columns, BK of D per product, warps, pipeline stages): the fastest of the
# launches `benchmarks/kernels.py eval-head` sweeps on an H100 (3.30 ms a 32,768-row pass; the
# others 3.40-5.07); the interpreter takes the smallest tiles tl.dot allows
LAUNCH = {"BM": 128, "BN": 128, "BK": 64, "warps": 8, "stages": 3}
# programs in flight to aim for when splitting the vocabulary (about two per SM of an H100; 132
# to 1,056 measured within the spread of one launch's repeats)
TARGET_PROGRAMS = 264
MAX_SPLIT = 16


def supported(h: Tensor, weight: Tensor) -> bool:
    """Whether the kernel runs: CUDA (or CPU under the interpreter), h and weight 2-D with unit
    column stride in one float dtype."""
    return (HAS_TRITON and (h.is_cuda or _INTERPRET) and h.device == weight.device
            and h.dtype in _DTYPES and weight.dtype == h.dtype and h.dim() == 2 and weight.dim() == 2
            and h.shape[1] == weight.shape[1] and h.stride(1) == 1 and weight.stride(1) == 1)


if HAS_TRITON:
    @triton.jit
    def _lse_step(z, cmask, m, s):
        """One tile's step of the online log-sum-exp in base 2: z (BM, BN) float32 logits times
        log2(e), cmask the columns inside the vocabulary. A row with no column yet keeps -inf and
        0 (its scale point is 0, so no -inf - -inf)."""
        z = tl.where(cmask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        at = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.math.exp2(m - at) + tl.sum(tl.math.exp2(z - at[:, None]), axis=1)
        return m_new, s

    @triton.jit
    def _lse_kernel(h_ptr, w_ptr, m_ptr, s_ptr, N, V, s_h, s_w, TILES: tl.constexpr,
                    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    PREC: tl.constexpr, STAGES: tl.constexpr):
        """One block of BM rows over the part's TILES tiles of BN columns (part = program 1): each
        row's maximum logit there and its sum of exp(z - maximum), written to (split, N) float32
        at [part, row] (a part past the vocabulary: -inf and 0). A tile's products over D in steps
        of BK, then its log-sum-exp step; the two loops flattened into one, so that the loads of
        the next tile are in flight during this tile's step. PREC: "" for 16-bit products on the
        tensor cores, else "ieee": float32 products (of the operands widened to float32)."""
        rb = tl.program_id(0)
        part = tl.program_id(1)
        rows = rb * BM + tl.arange(0, BM)
        rmask = rows < N
        m = tl.full([BM], float("-inf"), tl.float32)
        s = tl.zeros([BM], tl.float32)
        for i in tl.range(0, TILES, num_stages=STAGES, flatten=True):
            cols = (part * TILES + i) * BN + tl.arange(0, BN)
            cmask = cols < V
            acc = tl.zeros([BM, BN], tl.float32)
            for k in range(0, D, BK):
                ks = k + tl.arange(0, BK)
                kmask = ks < D
                a = tl.load(h_ptr + rows[:, None] * s_h + ks[None, :],
                            mask=rmask[:, None] & kmask[None, :], other=0.0)            # (BM, BK)
                b = tl.load(w_ptr + cols[:, None] * s_w + ks[None, :],
                            mask=cmask[:, None] & kmask[None, :], other=0.0)            # (BN, BK)
                if PREC == "":
                    acc = tl.dot(a, tl.trans(b), acc)
                else:   # float32 operands, or 16-bit ones widened (exact) for the interpreter
                    acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc,
                                 input_precision=PREC)
            m, s = _lse_step(acc * 1.4426950408889634, cmask, m, s)   # log2(e)
        out = part * N + rows
        tl.store(m_ptr + out, m * 0.6931471805599453, mask=rmask)   # ln(2)
        tl.store(s_ptr + out, s, mask=rmask)

    @triton.jit
    def _picked_kernel(h_ptr, w_ptr, t_ptr, p_ptr, N, V, s_h, s_w, D: tl.constexpr,
                       BM: tl.constexpr, BK: tl.constexpr, IGNORE: tl.constexpr):
        """Each row's target logit h . weight[target] (float32 sum of the products; 0 for an
        ignored target or one outside [0, V), whose weight row is never read)."""
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        rmask = rows < N
        t = tl.load(t_ptr + rows, mask=rmask, other=IGNORE)
        ok = rmask & (t >= 0) & (t < V)
        t = tl.where(ok, t, 0)
        acc = tl.zeros([BM], tl.float32)
        for k in range(0, D, BK):
            ks = k + tl.arange(0, BK)
            both = ok[:, None] & (ks < D)[None, :]
            a = tl.load(h_ptr + rows[:, None] * s_h + ks[None, :], mask=both, other=0.0)
            b = tl.load(w_ptr + t[:, None] * s_w + ks[None, :], mask=both, other=0.0)
            acc += tl.sum(a.to(tl.float32) * b.to(tl.float32), axis=1)
        tl.store(p_ptr + rows, acc, mask=rmask)


def _launch() -> dict:
    if _INTERPRET:
        return {"BM": 16, "BN": 16, "BK": 16, "warps": 1, "stages": 1}
    return LAUNCH


def split_for(n: int, V: int, bm: int, bn: int) -> int:
    """Programs a row block: enough row blocks x parts for TARGET_PROGRAMS, at most MAX_SPLIT and
    no more than the vocabulary's tiles."""
    blocks = max(1, triton.cdiv(n, bm))
    return max(1, min(MAX_SPLIT, triton.cdiv(V, bn), triton.cdiv(TARGET_PROGRAMS, blocks)))


def _check(h: Tensor, weight: Tensor, t: Tensor) -> None:
    check(supported(h, weight),
          lambda: f"linear_nll: h {tuple(h.shape)} {h.dtype} and weight {tuple(weight.shape)} "
                  f"{weight.dtype} must be 2-D, one float dtype, unit column stride, one device")
    check(t.shape == h.shape[:1],
          lambda: f"linear_nll: targets {tuple(t.shape)} must be ({h.shape[0]},)")


def _partials(h: Tensor, weight: Tensor, t: Tensor, split: int | None = None
              ) -> tuple[Tensor, Tensor, Tensor]:
    """The kernels' per-part maximum and sum, each (split, n) float32, and each row's target
    logit (1, n). TILES is a compile-time constant (the interpreter takes no loop over a runtime
    bound): one compiled kernel per vocabulary size and split, a few a pass."""
    n, D = h.shape
    V = weight.shape[0]
    cfg = _launch()
    split = split or split_for(n, V, cfg["BM"], cfg["BN"])
    # each part's columns a whole number of tiles (the last part may hold fewer, or none)
    span = triton.cdiv(triton.cdiv(V, split), cfg["BN"]) * cfg["BN"]
    f32 = dict(device=h.device, dtype=torch.float32)
    m, s = (torch.empty(split, n, **f32) for _ in range(2))
    p = torch.empty(1, n, **f32)
    if n:
        # float32 products in full precision; under the interpreter 16-bit operands too (its
        # bf16 products are wrong), widened first: the products of 16-bit values are exact in
        # float32, so only the order of the sums can differ from the GPU's
        prec = "ieee" if h.dtype == torch.float32 or _INTERPRET else ""
        torch.library.wrap_triton(_lse_kernel)[(triton.cdiv(n, cfg["BM"]), split)](
            h, weight, m, s, n, V, h.stride(0), weight.stride(0), TILES=span // cfg["BN"], D=D,
            BM=cfg["BM"], BN=cfg["BN"], BK=min(cfg["BK"], max(16, triton.next_power_of_2(D))),
            PREC=prec, STAGES=cfg["stages"], num_warps=cfg["warps"])
        pm = 64 if not _INTERPRET else 16
        torch.library.wrap_triton(_picked_kernel)[(triton.cdiv(n, pm),)](
            h, weight, t, p, n, V, h.stride(0), weight.stride(0), D=D, BM=pm,
            BK=min(64, max(16, triton.next_power_of_2(D))), IGNORE=IGNORE_INDEX, num_warps=4)
    return m, s, p


def _combine(m: Tensor, s: Tensor, p: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    top = m.amax(0)                                               # (n,) finite: a part has columns
    lse = top + (s * torch.exp(m - top)).sum(0).log()
    nll = torch.where(t != IGNORE_INDEX, lse - p.sum(0), lse.new_zeros(()))
    return nll, lse


def _nll_lse(h: Tensor, weight: Tensor, t: Tensor, split: int | None = None
             ) -> tuple[Tensor, Tensor]:
    _check(h, weight, t)
    m, s, p = _partials(h, weight, t.contiguous(), split)
    return _combine(m, s, p, t)


@triton_op("elephant::linear_nll", mutates_args=())
def _linear_nll_op(h: Tensor, weight: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    return _nll_lse(h, weight, t)


def linear_nll(h: Tensor, weight: Tensor, targets: Tensor, split: int | None = None
               ) -> tuple[Tensor, Tensor]:
    """Per-row NLL (0 where ignored) and log-sum-exp, float32, of the logits h @ weight.T (n, V),
    which are never written. `split`: programs a row block over the vocabulary (default
    `split_for`; the tests give it to cover empty and partial parts), outside the custom op."""
    if split is None:
        return _linear_nll_op(h, weight, targets)
    return _nll_lse(h, weight, targets, split)
