"""The output head's cross-entropy without its logits: linear + log-softmax + NLL, in row blocks.

    linear_cross_entropy(h (..., D), weight (V, D), targets (...), loss_mask, reduction)
        == F.cross_entropy(float32(h @ weight.T), targets) masked and reduced as ElephantLM.loss

Why: one chunk of the 70M recipe is 32 x 512 tokens over a 50,304-token vocabulary, so its logits
are 3.3 GB in float32, and cross-entropy keeps a float32 log-softmax of the same size for its
backward (evaluation with 64 lanes twice that). Here the rows pass in blocks of `block_rows`:
a block's logits are made, reduced to the per-token NLL (and, when training, to the block's part
of the gradients) and dropped, so at most `block_rows x V` logits exist at any time.

Two autograd paths:
  * a summed loss (`reduction` sum or mean, what training uses). The gradient that reaches a
    weighted sum of per-token NLLs is one scalar, so the forward pass computes the gradients of the
    head input and weight block by block (d logits = softmax - one-hot, scaled by the token's mask
    weight) and the backward only scales them by that scalar: the logits are made once, as in the
    reference, but never kept.
  * per-token NLL (`reduction="none"`, evaluation): without gradient it is the forward loop alone;
    with gradient the forward keeps each row's log-sum-exp and the backward remakes each block's
    logits.

Precision follows the reference: the matrix products run in the autocast dtype when autocast is on
(bf16 on the GPU), else in the inputs' dtype; softmax, log-sum-exp and NLL in float32 at least; the
weight gradient is summed over blocks in float32 (and on CUDA in half precision, the summed
loss's input gradient is kept as the matmul's float32 accumulator, where the reference rounds it
to half precision before its conversion back). `ignore_index` (-100) targets count zero, as in
F.cross_entropy. `linear_cross_entropy_reference` is the plain path (the whole logits, then
ElephantLM.loss) that the tests hold this one equal to.
"""
from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor

from elephant.layers import ce_triton, linear_nll_triton
from elephant.layers.triton_env import register_ops

IGNORE_INDEX = ce_triton.IGNORE_INDEX   # the targets every path skips (the loss kernels share it)
# float32 logits of one row block: at most 4 GiB (21,344 rows at V = 50,304; the block holds its
# logits and their gradient in bf16, 4 GiB together). A window's 32,768 rows at the recipe's shape
# are two blocks: against 1 GiB's eight, six fewer passes of the weight gradient's float32
# accumulation (V x D, read and written) and wider products, +1.3% tokens/s for +3.3 GB of peak
# memory (H100, 2026-11-26, docs/RESULTS.md)
BLOCK_BYTES = 4 << 30
REDUCTIONS = ("mean", "sum", "none")


def default_block_rows(vocab_size: int, n_rows: int | None = None) -> int:
    """Rows per block: at most BLOCK_BYTES of float32 logits, a multiple of 64 rows when that is
    > 64; given the row count, the fewest such blocks, evened out (32,768 rows at V = 50,304: two
    blocks of 16,384; at a 1 GiB cap, 16,384 rows were four blocks of 4,096, not three of 5,312
    and a tail). Each block adds its part of the weight
    gradient into the float32 total, a pass over V x D that fewer blocks make fewer times."""
    rows = max(1, BLOCK_BYTES // (4 * vocab_size))
    rows = rows // 64 * 64 if rows > 64 else rows
    if n_rows is None or n_rows <= rows:
        return rows if n_rows is None else max(1, n_rows)
    even = -(-n_rows // -(-n_rows // rows))                       # ceil(n / number of blocks)
    return min(rows, -(-even // 64) * 64) if rows >= 64 else even


# ------------------------------------------------------------------------------- reference
def reduce_nll(nll: Tensor, loss_mask: Tensor | None, reduction: str) -> Tensor:
    """Per-token NLL (...,) masked and reduced: mean divides by the mask's count (or all tokens)."""
    if loss_mask is not None:
        nll = nll * loss_mask
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    # torch.full, not torch.tensor: a tensor made from a host number is a copy the host waits for
    count = loss_mask.sum() if loss_mask is not None else torch.full((), nll.numel(), device=nll.device)
    return nll.sum() / count.clamp(min=1)


def cross_entropy_reference(logits: Tensor, targets: Tensor, loss_mask: Tensor | None = None,
                            reduction: str = "mean") -> Tensor:
    """Cross-entropy (in float32 at least) of whole logits (..., V) over the tokens of `loss_mask`."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    nll = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none")
    return reduce_nll(nll.view_as(targets), loss_mask, reduction)


def linear_cross_entropy_reference(h: Tensor, weight: Tensor, targets: Tensor,
                                   loss_mask: Tensor | None = None, reduction: str = "mean") -> Tensor:
    """The plain path: the whole logits h @ weight.T, then `cross_entropy_reference`."""
    return cross_entropy_reference(F.linear(h, weight), targets, loss_mask, reduction)


# ------------------------------------------------------------------------------- blocked path
def _matmul_dtype(h: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the reference's F.linear computes in: autocast's for float16/bfloat16/float32
    inputs when autocast is on for their device, else the promoted input dtype."""
    dtype = torch.promote_types(h.dtype, weight.dtype)
    device = h.device.type
    if dtype != torch.float64 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return dtype


def _no_autocast(device_type: str):
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) \
        else nullcontext()


def _block_nll(z: Tensor, targets: Tensor, softmax: bool = True
               ) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """Per-row NLL of float logits z (n, V), 0 where the target is ignored, and what the gradient
    needs: (nll, log-sum-exp, the softmax made in place of z (None without `softmax`: z is then
    spent), safe targets, valid). In place, so a block costs one (n, V) float buffer (a plain
    logsumexp would make a second one)."""
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)
    picked = z.gather(1, safe[:, None]).squeeze(1)                       # (n,)
    top = z.amax(dim=-1)                                                 # (n,)
    e = z.sub_(top[:, None]).exp_()                                      # (n, V) in place
    denom = e.sum(dim=-1)
    lse = top + denom.log()
    nll = torch.where(valid, lse - picked, torch.zeros((), dtype=z.dtype, device=z.device))
    return nll, lse, e.div_(denom[:, None]) if softmax else None, safe, valid


def _block_dlogits(p: Tensor, safe: Tensor, valid: Tensor, scale: Tensor) -> Tensor:
    """d nll / d logits of a block from its softmax p (n, V), each row times `scale` (n,):
    (softmax - one-hot) * scale, in place of p. Ignored rows get zero."""
    p.scatter_add_(1, safe[:, None], -valid[:, None].to(p.dtype))
    return p.mul_((scale * valid)[:, None])


# The same block math fused on CUDA: the logits stay in the matmul dtype (bf16 in training), where
# the in-place float32 steps above read and write a float32 block about ten times (that traffic
# was a quarter of the hybrid's training step on an H100). The in-place steps stay the CPU path
# and the reference the GPU tests hold the fused forms equal to.
FUSED = True           # False: the in-place float32 steps on CUDA too (the A/B and the tests)
# Which fused form: "triton", ce_triton's kernel (two reads of the logits and one write per block,
# eager and inside compiled graphs); "inductor", the plain functions below compiled by
# torch.compile (three reads and one write; what ran until 2026-11-25)
CE_KERNEL = os.environ.get("ELEPHANT_CE", "triton")
if CE_KERNEL not in ("triton", "inductor"):
    raise ValueError(f"ELEPHANT_CE must be 'triton' or 'inductor', got {CE_KERNEL!r}")


# Evaluation's per-row NLL (no gradient) as one kernel that never writes the logits
# (linear_nll_triton): 3.30 against 3.74 ms a 32,768-row pass on an H100, 1-2% of the 64-lane
# chunk step (2026-11-27; the earlier unflattened form lost, 4.59 ms). ELEPHANT_EVAL_FUSED=0: the
# blocked path (the A/B)
EVAL_FUSED = os.environ.get("ELEPHANT_EVAL_FUSED", "1") == "1"


def _use_eval_kernel(h: Tensor, weight: Tensor) -> bool:
    """Evaluation's fused head: on CUDA while EVAL_FUSED (the CPU suite runs under the Triton
    interpreter, where it would be slow: its tests call the kernel, or patch this)."""
    return EVAL_FUSED and h.is_cuda and linear_nll_triton.supported(h, weight)


def _use_ce_kernel(z: Tensor) -> bool:
    return CE_KERNEL == "triton" and z.is_cuda and ce_triton.supported(z)


def _block_fn(name: str, z: Tensor):
    """The functional block math for this block: on CUDA the Triton kernel (CE_KERNEL, eager or
    traced), else the separately compiled kernels (FUSED), the plain functions inside a graph
    torch.compile is tracing (it fuses them with the rest), else None for the in-place steps
    (eager CPU, or FUSED off). Never the in-place steps inside a traced graph: they and the eager
    path's slice writes gave an all-zero dh when traced with bf16 logits on an H100
    (test_blocked_head_equals_reference_on_cuda[sum-bf16-True], LOG.md)."""
    if torch.compiler.is_compiling():
        return ce_triton.FNS[name] if _use_ce_kernel(z) else PLAIN_FNS[name]
    if not (FUSED and _fusable(z)):
        return None
    return ce_triton.FNS[name] if _use_ce_kernel(z) else _fused(name)


def _acc(total: Tensor | None, part: Tensor, dtype: torch.dtype) -> Tensor:
    """total + part, accumulated in `dtype` (the first part is converted once, later ones are
    added as they are): in place when eager, a new tensor inside a traced graph (see _block_fn)."""
    if total is None:
        return part.to(dtype)
    return total + part if torch.compiler.is_compiling() else total.add_(part)


# CUDA, half-precision products summed in float32: the matmul writes into the float32 sum itself
# (addmm with out_dtype), instead of making a half-precision (V, D) product and adding it in a pass
# of its own (two reads and a write of the whole weight gradient per block); False after a failure
ACC_IN_MATMUL = True


def _in_matmul(call) -> Tensor | None:
    """call(), a matmul that writes float32 from half-precision factors (out_dtype), while
    ACC_IN_MATMUL holds; None once it failed (a torch without it: the flag turns off and the
    caller takes its half-precision product)."""
    global ACC_IN_MATMUL
    if not ACC_IN_MATMUL:
        return None
    try:
        return call()
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError, NotImplementedError):
        ACC_IN_MATMUL = False
        return None


def _float32_matmul(a: Tensor, dtype: torch.dtype) -> bool:
    """Whether a product of `a` (and a factor of its dtype) can write `dtype` from the matmul's
    own accumulator: CUDA, bfloat16/float16 factors, a float32 result, eager, while
    ACC_IN_MATMUL holds."""
    return (ACC_IN_MATMUL and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16)
            and dtype == torch.float32 and not torch.compiler.is_compiling())


def _acc_mm(total: Tensor | None, a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """total + a @ b accumulated in `dtype` (see _acc). On CUDA with bfloat16/float16 factors and a
    float32 sum, eager: the product goes straight into the float32 sum inside the matmul (its
    float32 accumulator is not rounded to half precision first)."""
    if _float32_matmul(a, dtype):
        out = _in_matmul(lambda: torch.mm(a, b, out_dtype=dtype) if total is None
                         else torch.addmm(total, a, b, out_dtype=dtype, out=total))
        if out is not None:
            return out
    return _acc(total, a @ b, dtype)


def _mm_into(out: Tensor, a: Tensor, b: Tensor) -> None:
    """out = a @ b, with out float32 and a, b in half precision on CUDA: the matmul writes its
    float32 accumulator straight into `out` (a slice of a larger buffer, so the blocks need no
    concatenation); after a failure (ACC_IN_MATMUL off), the half-precision product copied in."""
    if _in_matmul(lambda: torch.mm(a, b, out_dtype=out.dtype, out=out)) is None:
        out.copy_(a @ b)


def _fusable(z: Tensor) -> bool:
    return z.is_cuda and z.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _nll_lse(z: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row NLL (0 where ignored) and log-sum-exp of logits z (n, V), in float32 at least."""
    zf = z.to(torch.promote_types(z.dtype, torch.float32))
    valid = targets != IGNORE_INDEX
    lse = torch.logsumexp(zf, dim=-1)
    picked = zf.gather(1, torch.where(valid, targets, 0)[:, None]).squeeze(1)
    return torch.where(valid, lse - picked, 0.0), lse


def _dlogits(z: Tensor, lse: Tensor, targets: Tensor, scale: Tensor) -> Tensor:
    """(softmax - one-hot) * scale of logits z (n, V) from their log-sum-exp, in z's dtype."""
    zf = z.to(lse.dtype)
    valid = targets != IGNORE_INDEX
    hot = torch.arange(z.shape[1], device=z.device) == torch.where(valid, targets, -1)[:, None]
    d = (torch.exp(zf - lse[:, None]) - hot.to(zf.dtype)) * (scale.to(zf.dtype) * valid)[:, None]
    return d.to(z.dtype)


def _nll_and_dlogits(z: Tensor, targets: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    nll, lse = _nll_lse(z, targets)
    return nll, lse, _dlogits(z, lse, targets, scale)


# compiled on first call; the last, shorter block of a pass makes the shapes dynamic after its
# first recompile. Made at the first use, not at import: torch.compile imports dynamo (~1.4 s of
# a process's start on a CPU), and a GPU process whose head takes the Triton loss never uses them
PLAIN_FNS = {"nll": _nll_lse, "grad": _nll_and_dlogits, "dlogits": _dlogits}
_FUSED_FNS: dict = {}


def _fused(name: str):
    """PLAIN_FNS[name] compiled (once a process)."""
    fn = _FUSED_FNS.get(name)
    if fn is None:
        register_ops()   # nothing of them waits for it, but nothing may wait while dynamo traces
        fn = _FUSED_FNS[name] = torch.compile(PLAIN_FNS[name])
    return fn


def _blocks(n: int, block_rows: int):
    for start in range(0, n, block_rows):
        yield slice(start, min(start + block_rows, n))


def _forward_nll(h2: Tensor, w: Tensor, t: Tensor, block_rows: int, keep_lse: bool = False):
    """Per-row NLL (N,) of h2 (N, D) already in the matmul dtype (and each row's log-sum-exp)."""
    out_dtype = torch.promote_types(h2.dtype, torch.float32)
    nll, lse = [], []
    for rows in _blocks(h2.shape[0], block_rows):
        z = h2[rows] @ w.t()                                             # (n, V) logits
        fn = _block_fn("nll", z)
        if fn is not None:
            block_nll, block_lse = fn(z, t[rows])
        else:
            block_nll, block_lse, _, _, _ = _block_nll(z.to(out_dtype), t[rows], softmax=False)
        nll.append(block_nll)
        lse.append(block_lse)
    if not nll:   # no rows
        empty = h2.new_zeros(0, dtype=out_dtype)
        return empty, empty if keep_lse else None
    return torch.cat(nll), torch.cat(lse) if keep_lse else None


class _SummedNLL(torch.autograd.Function):
    """sum_i scale_i * nll_i over rows, with the gradients made in the forward pass."""

    @staticmethod
    def forward(ctx, h2, weight, t, scale, block_rows, dtype):
        hc, wc = h2.to(dtype), weight.to(dtype)
        out_dtype = torch.promote_types(dtype, torch.float32)
        total = grad_w = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # on CUDA in half precision the input's gradient is kept in float32, written block by
        # block by the matmul into one buffer: no concatenation, and the backward's scaling is
        # one pass that reads it as it is (a half-precision gradient was concatenated, converted
        # and scaled in three passes)
        wide = need_h and _float32_matmul(hc, out_dtype)
        grad_h = torch.empty(hc.shape, dtype=out_dtype, device=hc.device) if wide else []
        with _no_autocast(h2.device.type):
            for rows in _blocks(hc.shape[0], block_rows):
                z = hc[rows] @ wc.t()                                    # (n, V)
                s = scale[rows].to(out_dtype)
                fn = _block_fn("grad", z)
                if fn is not None:
                    nll, _, dz = fn(z, t[rows], s)
                else:
                    nll, _, softmax, safe, valid = _block_nll(z.to(out_dtype), t[rows])
                    dz = _block_dlogits(softmax, safe, valid, s).to(dtype)
                total = _acc(total, (nll * s).sum(), out_dtype)
                if wide:
                    _mm_into(grad_h[rows], dz, wc)                       # (n, D) float32
                elif need_h:
                    grad_h.append(dz @ wc)                               # (n, D)
                if need_w:
                    grad_w = _acc_mm(grad_w, dz.t(), hc[rows], out_dtype)  # (V, D)
        if total is None:   # no rows
            total = hc.new_zeros((), dtype=out_dtype)
        if not wide:
            grad_h = (torch.cat(grad_h) if grad_h else torch.zeros_like(hc)) if need_h else None
        if need_w and grad_w is None:
            grad_w = torch.zeros(weight.shape, dtype=out_dtype, device=weight.device)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h2.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, g):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        dh = None if grad_h is None else (grad_h.to(g.dtype) * g).to(h_dtype)
        dw = None if grad_w is None else (grad_w * g.to(grad_w.dtype)).to(w_dtype)
        return dh, dw, None, None, None, None


class _PerTokenNLL(torch.autograd.Function):
    """Per-row NLL (N,); the backward remakes each block's logits from the saved log-sum-exp."""

    @staticmethod
    def forward(ctx, h2, weight, t, block_rows, dtype):
        hc, wc = h2.to(dtype), weight.to(dtype)
        with _no_autocast(h2.device.type):
            nll, lse = _forward_nll(hc, wc, t, block_rows, keep_lse=True)
        ctx.save_for_backward(h2, weight, t, lse)
        ctx.block_rows, ctx.dtype = block_rows, dtype
        return nll

    @staticmethod
    def backward(ctx, g):
        h2, weight, t, lse = ctx.saved_tensors
        dtype, block_rows = ctx.dtype, ctx.block_rows
        hc, wc = h2.to(dtype), weight.to(dtype)
        out_dtype = lse.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h, grad_w = [], None
        for rows in _blocks(hc.shape[0], block_rows):
            z = hc[rows] @ wc.t()
            fn = _block_fn("dlogits", z)
            if fn is not None:
                dz = fn(z, lse[rows], t[rows], g[rows].to(out_dtype))
            else:
                z = z.to(out_dtype)
                valid = t[rows] != IGNORE_INDEX
                safe = torch.where(valid, t[rows], 0)
                softmax = z.sub_(lse[rows, None]).exp_()
                dz = _block_dlogits(softmax, safe, valid, g[rows].to(out_dtype)).to(dtype)
            if need_h:
                grad_h.append(dz @ wc)
            if need_w:
                grad_w = _acc_mm(grad_w, dz.t(), hc[rows], out_dtype)
        grad_h = (torch.cat(grad_h) if grad_h else torch.zeros_like(hc)) if need_h else None
        if need_w and grad_w is None:
            grad_w = torch.zeros(weight.shape, dtype=out_dtype, device=weight.device)
        return (None if grad_h is None else grad_h.to(h2.dtype),
                None if grad_w is None else grad_w.to(weight.dtype), None, None, None)


def linear_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, loss_mask: Tensor | None = None,
                         reduction: str = "mean", block_rows: int | None = None) -> Tensor:
    """Cross-entropy of the logits h @ weight.T over the tokens of `loss_mask`, never holding more
    than `block_rows` rows of logits (default: `default_block_rows(V)`). Same arguments and result as
    `linear_cross_entropy_reference`: h (..., D), weight (V, D), targets (...) int64, loss_mask (...)
    bool or float weights; reduction mean (over the mask's count) / sum / none (per token, masked)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if weight.dim() != 2 or h.shape[-1] != weight.shape[1]:
        raise ValueError(f"head weight {tuple(weight.shape)} does not fit inputs {tuple(h.shape)} "
                         f"(expected (V, {h.shape[-1]}))")
    if targets.shape != h.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be the inputs' leading shape "
                         f"{tuple(h.shape[:-1])}")
    if loss_mask is not None and loss_mask.shape != targets.shape:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} must have the targets' shape "
                         f"{tuple(targets.shape)}")
    if block_rows is None:
        block_rows = default_block_rows(weight.shape[0], targets.numel())
    elif block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    dtype = _matmul_dtype(h, weight)
    h2, t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    if reduction != "none" and grad:
        scale = (loss_mask.reshape(-1) if loss_mask is not None
                 else torch.ones((), device=h.device).expand(t.shape[0]))
        total = _SummedNLL.apply(h2, weight, t, scale, block_rows, dtype)
        if reduction == "sum":
            return total
        count = (loss_mask.sum() if loss_mask is not None
                 else torch.full((), t.numel(), device=h.device))
        return total / count.clamp(min=1)
    if grad:
        nll = _PerTokenNLL.apply(h2, weight, t, block_rows, dtype)
    else:
        with _no_autocast(h.device.type):
            hc, wc = h2.to(dtype), weight.to(dtype)
            if _use_eval_kernel(hc, wc):
                nll = linear_nll_triton.linear_nll(hc, wc, t)[0]
            else:
                nll = _forward_nll(hc, wc, t, block_rows)[0]
    return reduce_nll(nll.view(targets.shape), loss_mask, reduction)
