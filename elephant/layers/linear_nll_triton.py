"""Evaluation's head as one Triton kernel: per-row NLL and log-sum-exp of h @ W^T, logits never
written.

    linear_nll(h (n, D), weight (V, D), targets (n,)) -> (nll (n,), lse (n,))     float32

The same contract as head._forward_nll (the blocked path evaluation runs today, and what the tests
hold this to): zero NLL for an ignored target (-100), no logit read for a target outside [0, V).

Why: in evaluation the blocked head makes each block's logits in bf16 (3.3 GB for one 64-lane
chunk step of the 70M recipe) and ce_triton's NLL kernel reads them back once. On an H100 that is
~3.7 ms of a ~15.5 ms step: the product ~2.6 ms, the NLL's read ~1.0 ms, and the product's write of
the logits inside the first. The 64-lane pass runs at the GPU's power limit, so bytes not moved are
time saved (docs/RESULTS.md, issue 12, session 38).

How: a program holds BM rows of h and walks its share of the vocabulary in tiles of BN columns.
For each tile it forms the logits in registers (products over D in steps of BK, float32
accumulation). It folds them into an online log-sum-exp (running maximum, rescaled sum) and
picks up the target's logit. The vocabulary is split over SPLIT programs a row block, so that
enough programs are in flight for a short batch; their partial (maximum, sum, picked) are combined
by a few small torch ops. The logits are float32 sums of the matmul dtype's products, never
rounded to bf16 as the blocked path's are: the two agree to that rounding.

Status: built in session 38, held to a float64 reference on the CPU (under the interpreter) and
to the float32 logits and the blocked path on an H100 (tests/test_gpu_model.py). Measured there
slower, so `head.EVAL_FUSED` keeps it off: 4.59 ms a 32,768-row pass at its best launch of seven
(128 x 128 tiles, products of 64, 8 warps, 3 stages) against the blocked path's 3.68 ms (cuBLAS's
product 2.85 ms and the NLL kernel's read of the bf16 logits). Its products, reloading both
operands for every tile, run well below cuBLAS's; a GEMM-grade main loop (the h block kept on
chip across the vocabulary, TMA loads, warp specialization) is what it would need to pay
(`benchmarks/bench_eval_head.py`; `train_speed.py --eval-modes side,side_fused` for the 64-lane
A/B in one process).

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

# (BM rows, BN vocabulary columns, BK of D per product, warps, pipeline stages): the fastest of the
# seven launches benchmarks/bench_eval_head.py sweeps on an H100 (4.59 ms a 32,768-row pass; the
# others 4.71-6.68); the interpreter takes the smallest tiles tl.dot allows
LAUNCH = {"BM": 128, "BN": 128, "BK": 64, "warps": 8, "stages": 3}
# programs in flight to aim for when splitting the vocabulary (about two per SM of an H100)
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
    def _linear_nll_kernel(h_ptr, w_ptr, t_ptr, m_ptr, s_ptr, p_ptr, N, V, s_h, s_w, span,
                           D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           IGNORE: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr):
        """One block of BM rows over the vocabulary columns [part * span, (part + 1) * span):
        each row's maximum logit there, its sum of exp(z - maximum) and its target's logit (0 when
        the target is not among these columns), written to (SPLIT, N) float32 at [part, row].
        PREC: "" for 16-bit products on the tensor cores, else "ieee": float32 products (of
        the operands widened to float32)."""
        rb = tl.program_id(0)
        part = tl.program_id(1)
        rows = rb * BM + tl.arange(0, BM)
        rmask = rows < N
        t = tl.load(t_ptr + rows, mask=rmask, other=IGNORE)
        m = tl.full([BM], float("-inf"), tl.float32)
        s = tl.zeros([BM], tl.float32)
        picked = tl.zeros([BM], tl.float32)
        lo = part * span
        hi = tl.minimum(lo + span, V)
        start = lo
        while start < hi:  # a while loop: the interpreter takes no range() over runtime bounds
            cols = start + tl.arange(0, BN)
            cmask = cols < hi
            acc = tl.zeros([BM, BN], tl.float32)
            for k in tl.range(0, D, BK, num_stages=STAGES):
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
            z = tl.where(cmask[None, :], acc, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=1))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
            m = m_new
            picked += tl.sum(tl.where(cols[None, :] == t[:, None], acc, 0.0), axis=1)
            start += BN
        out = part * N + rows
        tl.store(m_ptr + out, m, mask=rmask)
        tl.store(s_ptr + out, s, mask=rmask)
        tl.store(p_ptr + out, picked, mask=rmask)


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
    torch._check(supported(h, weight),
                 lambda: f"linear_nll: h {tuple(h.shape)} {h.dtype} and weight {tuple(weight.shape)} "
                         f"{weight.dtype} must be 2-D, one float dtype, unit column stride, one device")
    torch._check(t.shape == h.shape[:1],
                 lambda: f"linear_nll: targets {tuple(t.shape)} must be ({h.shape[0]},)")


def _partials(h: Tensor, weight: Tensor, t: Tensor, split: int | None = None
              ) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's per-part (maximum, sum, picked), each (split, n) float32."""
    n, D = h.shape
    V = weight.shape[0]
    cfg = _launch()
    split = split or split_for(n, V, cfg["BM"], cfg["BN"])
    # each part's columns a whole number of tiles (the last part may hold fewer, or none)
    span = triton.cdiv(triton.cdiv(V, split), cfg["BN"]) * cfg["BN"]
    f32 = dict(device=h.device, dtype=torch.float32)
    m, s, p = (torch.empty(split, n, **f32) for _ in range(3))
    if n:
        # float32 products in full precision; under the interpreter 16-bit operands too (its
        # bf16 products are wrong), widened first: the products of 16-bit values are exact in
        # float32, so only the order of the sums can differ from the GPU's
        prec = "ieee" if h.dtype == torch.float32 or _INTERPRET else ""
        torch.library.wrap_triton(_linear_nll_kernel)[(triton.cdiv(n, cfg["BM"]), split)](
            h, weight, t, m, s, p, n, V, h.stride(0), weight.stride(0), span,
            D=D, BM=cfg["BM"], BN=cfg["BN"], BK=min(cfg["BK"], max(16, triton.next_power_of_2(D))),
            IGNORE=IGNORE_INDEX, PREC=prec, STAGES=cfg["stages"], num_warps=cfg["warps"])
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


@torch.library.triton_op("elephant::linear_nll", mutates_args=())
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
