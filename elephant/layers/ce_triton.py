"""The blocked loss's per-block math as one Triton kernel: log-sum-exp, NLL, the logits' gradient.

    nll_lse(z, targets)                   -> (nll, lse)          per row of logits z (n, V)
    nll_lse_dlogits(z, targets, scale)    -> (nll, lse, dz)      dz = (softmax - one-hot) * scale
    dlogits(z, lse, targets, scale)       -> dz                  from a log-sum-exp made before

The same contract as head._nll_lse / _nll_and_dlogits / _dlogits (the functions inductor compiles
and the tests hold these to): float32 math on logits in any float dtype, dz in z's dtype, zero NLL
and gradient for an ignored target (-100). A target outside [0, V) reads no logit (the trainer
refuses a tokenizer whose ids do not fit the vocabulary before any step).

Why: a block of 4,096 x 50,304 bf16 logits is 412 MB (the head's blocks hold up to 21,312 such rows). The
kernel inductor makes of the plain functions reads each row three times (its maximum, the sum of
exponentials, then the gradient) and writes the gradient: about 1.65 GB per block. Here one
program walks one row twice: an online log-sum-exp (the running maximum and the rescaled sum in
one read), then the gradient (a second read, one write): 1.24 GB, a quarter less traffic. The NLL
alone (evaluation) is one read instead of two.

The second read is meant to come from L2 (50 MB on an H100), so the gradient's loads and stores
carry eviction hints (`L2_HINTS`): the first walk asks L2 to keep the row (evict_last), the second
reads it and writes dz as data not to be kept (evict_first), so the gradient's writes do not push
out rows still to be read. On an H100 the recipe's block (16,384 x 50,304 bf16) ran 1,561 -> 1,335
us, a plain copy of the same bytes 1,135 (benchmarks/kernels.py ce, docs/RESULTS.md).

Registered with torch.library.triton_op (inductor launches the kernel from its own code inside a
compiled chunk). Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .triton_env import FLOAT_DTYPES as _DTYPES
from .triton_env import HAS_TRITON, tl, triton
from .triton_env import INTERPRET as _INTERPRET
from .triton_env import check, triton_op

IGNORE_INDEX = -100
# (vocabulary elements per step of a row's walk, warps): among the fastest of the sweep of
# benchmarks/kernels.py ce on an H100 (4,096 x 50,304 bf16; grad 406 us against inductor's 575,
# nll 146 against 301; neighbouring launches within a few percent)
LAUNCH = {"nll": (2048, 4), "grad": (8192, 8)}
# the gradient's walk over a row runs from its end, whose blocks the first walk read last: 3-10%
# faster than from its start at every launch of the sweep (8192 x 8: 406 us against 421)
GRAD_REVERSED = True
# L2 eviction hints on the gradient's walks (see the module doc): in a sweep of the recipe's
# block (H100, 2026-11-27), 12% faster at this launch (8192 x 8, reversed), up to 21% at others,
# and within 2% either way at the two launches of 16,384 x 16 warps
L2_HINTS = True


def supported(z: Tensor) -> bool:
    """Whether the kernel runs on these logits (CUDA, or CPU under the interpreter; float dtypes
    whose math is float32: float64 logits take the plain functions)."""
    return HAS_TRITON and (z.is_cuda or _INTERPRET) and z.dtype in _DTYPES and z.dim() == 2


if HAS_TRITON:
    @triton.jit
    def _ce_kernel(z_ptr, t_ptr, scale_ptr, lse_in_ptr, nll_ptr, lse_ptr, dz_ptr, V, s_z, s_dz,
                   BLOCK: tl.constexpr, FORWARD: tl.constexpr, GRAD: tl.constexpr,
                   IGNORE: tl.constexpr, REVERSED: tl.constexpr, KEEP: tl.constexpr,
                   DROP: tl.constexpr):
        """One row. FORWARD: its log-sum-exp (online: running maximum m, sum s of exp(z - m)) and
        NLL; else the log-sum-exp is read. GRAD: dz = (exp(z - lse) - one-hot) * scale * valid.
        KEEP, DROP: the eviction policies of the first walk's loads and of the gradient walk's
        loads and stores ("" for none)."""
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * s_z
        t = tl.load(t_ptr + row)
        valid = t != IGNORE
        LOG2E: tl.constexpr = 1.4426950408889634
        if FORWARD:
            m = tl.full([], float("-inf"), tl.float32)
            s = tl.zeros([], tl.float32)
            start = 0
            while start < V:  # a while loop: the interpreter takes no range() over a runtime V
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(z_row + offs, mask=offs < V, other=float("-inf"),
                            eviction_policy=KEEP).to(tl.float32)
                m_new = tl.maximum(m, tl.max(x, axis=0))
                s = s * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2((x - m_new) * LOG2E), axis=0)
                m = m_new
                start += BLOCK
            lse = m + tl.log(s)
            inside = valid & (t >= 0) & (t < V)
            picked = tl.load(z_row + tl.where(inside, t, 0), mask=inside, other=0.0).to(tl.float32)
            tl.store(nll_ptr + row, tl.where(valid, lse - picked, 0.0))
            tl.store(lse_ptr + row, lse)
        else:
            lse = tl.load(lse_in_ptr + row)
        if GRAD:
            sc = tl.where(valid, tl.load(scale_ptr + row).to(tl.float32), 0.0)
            dz_row = dz_ptr + row * s_dz
            # REVERSED: from the row's end, whose blocks the first walk read last (likeliest
            # still in L2); else from its start
            start = 0
            if REVERSED:
                start = ((V - 1) // BLOCK) * BLOCK
            while (start >= 0) & (start < V):
                offs = start + tl.arange(0, BLOCK)
                vmask = offs < V
                x = tl.load(z_row + offs, mask=vmask, other=0.0, eviction_policy=DROP).to(tl.float32)
                d = (tl.exp2((x - lse) * LOG2E) - tl.where(offs == t, 1.0, 0.0)) * sc
                tl.store(dz_row + offs, d.to(dz_ptr.dtype.element_ty), mask=vmask,
                         eviction_policy=DROP)
                if REVERSED:
                    start -= BLOCK
                else:
                    start += BLOCK


def _launch(kind: str, V: int) -> tuple[int, int]:
    """(block, warps): small blocks under the interpreter, LAUNCH on the GPU (no larger than V)."""
    block, warps = (64, 1) if _INTERPRET else LAUNCH[kind]
    return min(block, triton.next_power_of_2(V)), warps


def _check(z: Tensor, t: Tensor) -> None:
    check(z.dim() == 2 and z.stride(1) == 1,
          lambda: f"ce_triton: logits must be (rows, V) with contiguous rows, got "
                  f"{tuple(z.shape)} strides {z.stride()}")
    check(t.shape == z.shape[:1], lambda: f"ce_triton: targets {tuple(t.shape)} must be "
                                          f"({z.shape[0]},)")


def _run(z: Tensor, t: Tensor, scale: Tensor | None, lse_in: Tensor | None, grad: bool):
    """The kernel over every row of z: (nll, lse, dz), each None where not made."""
    _check(z, t)
    t = t.contiguous()
    scale = None if scale is None else scale.float().contiguous()
    lse_in = None if lse_in is None else lse_in.float().contiguous()
    n, V = z.shape
    forward = lse_in is None
    f32 = dict(device=z.device, dtype=torch.float32)
    nll = torch.empty(n, **f32) if forward else None
    lse = torch.empty(n, **f32) if forward else lse_in
    dz = torch.empty(n, V, device=z.device, dtype=z.dtype) if grad else None
    block, warps = _launch("grad" if grad else "nll", V)
    # hints only where a row is read twice (the NLL alone reads it once)
    keep, drop = ("evict_last", "evict_first") if L2_HINTS and grad and forward else ("", "")
    if n:
        dummy = lse
        torch.library.wrap_triton(_ce_kernel)[(n,)](
            z, t, scale if grad else dummy, lse_in if not forward else dummy,
            nll if forward else dummy, lse, dz if grad else dummy, V, z.stride(0),
            dz.stride(0) if grad else 0, BLOCK=block, FORWARD=forward, GRAD=grad,
            IGNORE=IGNORE_INDEX, REVERSED=GRAD_REVERSED, KEEP=keep, DROP=drop, num_warps=warps)
    return nll, lse, dz


@triton_op("elephant::ce_nll", mutates_args=())
def _nll_op(z: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    nll, lse, _ = _run(z, t, None, None, False)
    return nll, lse


@triton_op("elephant::ce_nll_dlogits", mutates_args=())
def _nll_dlogits_op(z: Tensor, t: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _run(z, t, scale, None, True)


@triton_op("elephant::ce_dlogits", mutates_args=())
def _dlogits_op(z: Tensor, lse: Tensor, t: Tensor, scale: Tensor) -> Tensor:
    return _run(z, t, scale, lse, True)[2]


def nll_lse(z: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row NLL (0 where ignored) and log-sum-exp (float32) of logits z (n, V)."""
    return _nll_op(z, targets)


def nll_lse_dlogits(z: Tensor, targets: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """nll_lse and the gradient (softmax - one-hot) * scale, in z's dtype."""
    return _nll_dlogits_op(z, targets, scale)


def dlogits(z: Tensor, lse: Tensor, targets: Tensor, scale: Tensor) -> Tensor:
    """(softmax - one-hot) * scale of logits z from their log-sum-exp, in z's dtype."""
    return _dlogits_op(z, lse, targets, scale)


FNS = {"nll": nll_lse, "grad": nll_lse_dlogits, "dlogits": dlogits}
