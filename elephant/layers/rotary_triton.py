"""The attention's queries, keys and values from the qkv projection, as one Triton kernel each way.

    qkv_prepare(y, cos, sin, wq, wk, eps, heads) -> q, k, v     each (B, H, S, hd), y's dtype

y (B, S, 3 * H * hd) is the projection's output ([q | k | v], heads inside each); cos and sin
(B, S, hd / 2) float32 are the rotary tables (`attention.rotary_cos_sin`); wq / wk (hd,) the
q_norm / k_norm weights, or None for no norm. The same contract as `Attention.project`'s plain
path, which the tests hold this to: float32 math, q and k RMS-normalized over hd (eps) and
scaled, then rotated (rotate-half pairs (i, i + hd/2)), v as it is; outputs in y's dtype.

Layout: each output is a (B, H, S, hd) view of its own (B, S, H, hd) storage (token-major, as y's
heads are and as FlashAttention's varlen kernel takes its (B * S, H, hd) rows), so flattening it
for that kernel (`attention.attend_varlen`) is a view, not a copy. The backward reads the three
outputs' gradients in place at any strides over b, h and s (the varlen path's come back as
token-major views, its keys' and values' as slices of them; SDPA's as (B, H, S, hd)); one strided
over hd is copied first.

Why: compiled, the plain path is a permute, a norm (a reduction kernel, then a pointwise kernel),
the rotation (a gather of the two halves) and, in the backward, a stack of the three gradients:
about 125 us forward and 190 us backward per attention layer's chunk at the wt103-70m shape
(32 x 528 tokens, 8 heads of 64), where the bytes would take about 25. Here one program takes one
token: it reads the token's q and k rows once (all heads), reads its rotary angles once for the
2H rows, and writes q, k and v where attention reads them; the backward writes the whole of y's
gradient (no stack) and each program's partial sums of the norm weights' gradients.

Registered with torch.library.triton_op (inductor launches the kernels inside a compiled chunk).
Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .triton_env import FLOAT_DTYPES as _DTYPES
from .triton_env import HAS_TRITON, tl, triton
from .triton_env import INTERPRET as _INTERPRET
from .triton_env import is_pow2, register_autograd, triton_op


def supported(y: Tensor, heads: int, head_dim: int) -> bool:
    """Whether the kernels take this projection output (CUDA, or CPU under the interpreter; float
    dtypes whose math is float32; power-of-two heads and head size, as the kernels' tiles are)."""
    return (HAS_TRITON and (y.is_cuda or _INTERPRET) and y.dtype in _DTYPES and y.dim() == 3
            and is_pow2(heads) and is_pow2(head_dim) and head_dim >= 2)


if HAS_TRITON:
    @triton.jit
    def _token(S, H: tl.constexpr, HALF: tl.constexpr):
        """This program's token (b, s): its index b * S + s, b and s, and the head and half-row
        ranges (H, 1) and (1, HALF). It takes no pointer: inductor's analysis of which tensors a
        kernel writes counts every pointer a helper is given as flowing into what it returns, so
        stores addressed with these ranges would have made y, cos and sin look written (and
        inductor copied them for each launch)."""
        tok = tl.program_id(0).to(tl.int64)
        return tok, tok // S, tok % S, tl.arange(0, H)[:, None], tl.arange(0, HALF)[None, :]

    @triton.jit
    def _fwd_rows(src, dst, w_ptr, cos, sin, eps, rows, cols, HALF: tl.constexpr,
                  HD: tl.constexpr, NORM: tl.constexpr):
        """One token's H rows of q (or k): normalized, scaled, rotated, stored at dst."""
        x1 = tl.load(src + rows * HD + cols).to(tl.float32)                # (H, HALF)
        x2 = tl.load(src + rows * HD + HALF + cols).to(tl.float32)
        if NORM:
            r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HD + eps)[:, None]
            x1 = x1 * r * tl.load(w_ptr + cols).to(tl.float32)
            x2 = x2 * r * tl.load(w_ptr + HALF + cols).to(tl.float32)
        ty = dst.dtype.element_ty
        tl.store(dst + cols, (x1 * cos - x2 * sin).to(ty))
        tl.store(dst + HALF + cols, (x2 * cos + x1 * sin).to(ty))

    @triton.jit
    def _qkv_fwd_kernel(y_ptr, cos_ptr, sin_ptr, wq_ptr, wk_ptr, q_ptr, k_ptr, v_ptr, S, s_yb, s_ys,
                        eps, H: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                        NORM: tl.constexpr):
        """One token (b, s): q and k of all heads normalized and rotated, v copied, each to its
        H rows of (B, S, H, HD) storage."""
        tok, b, s, rows, cols = _token(S, H, HALF)
        src = y_ptr + b * s_yb + s * s_ys
        cos = tl.load(cos_ptr + tok * HALF + cols)                         # (1, HALF)
        sin = tl.load(sin_ptr + tok * HALF + cols)
        out = (tok * H + rows) * HD                                        # (H, 1)
        _fwd_rows(src, q_ptr + out, wq_ptr, cos, sin, eps, rows, cols, HALF, HD, NORM)
        _fwd_rows(src + H * HD, k_ptr + out, wk_ptr, cos, sin, eps, rows, cols, HALF, HD, NORM)
        full = tl.arange(0, HD)[None, :]
        tl.store(v_ptr + out + full, tl.load(src + 2 * H * HD + rows * HD + full))

    @triton.jit
    def _bwd_rows(src, g, dst, w_ptr, dw_ptr, cos, sin, eps, rows, cols, HALF: tl.constexpr,
                  HD: tl.constexpr, NORM: tl.constexpr):
        """The gradient of one token's H rows of q (or k) at dst (y's layout), from g (the
        output's gradient rows), and the token's partial sums of dLoss/dw at dw_ptr (HD,)."""
        g1 = tl.load(g + cols).to(tl.float32)                              # (H, HALF)
        g2 = tl.load(g + HALF + cols).to(tl.float32)
        d1 = g1 * cos + g2 * sin                                           # the rotation undone
        d2 = g2 * cos - g1 * sin
        if NORM:
            x1 = tl.load(src + rows * HD + cols).to(tl.float32)
            x2 = tl.load(src + rows * HD + HALF + cols).to(tl.float32)
            r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HD + eps)[:, None]
            tl.store(dw_ptr + cols, tl.sum(d1 * x1 * r, axis=0)[None, :])
            tl.store(dw_ptr + HALF + cols, tl.sum(d2 * x2 * r, axis=0)[None, :])
            d1 = d1 * tl.load(w_ptr + cols).to(tl.float32)
            d2 = d2 * tl.load(w_ptr + HALF + cols).to(tl.float32)
            # d/dx of x r: r (d - x r^2 mean(d x))
            dot = ((tl.sum(d1 * x1, axis=1) + tl.sum(d2 * x2, axis=1)) / HD)[:, None] * r * r
            d1 = r * (d1 - x1 * dot)
            d2 = r * (d2 - x2 * dot)
        ty = dst.dtype.element_ty
        tl.store(dst + rows * HD + cols, d1.to(ty))
        tl.store(dst + rows * HD + HALF + cols, d2.to(ty))

    @triton.jit
    def _qkv_bwd_kernel(y_ptr, cos_ptr, sin_ptr, wq_ptr, wk_ptr, dq_ptr, dk_ptr, dv_ptr, dy_ptr,
                        dwq_ptr, dwk_ptr, S, s_yb, s_ys, s_qb, s_qh, s_qs, s_kb, s_kh, s_ks, s_vb,
                        s_vh, s_vs, eps, H: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                        NORM: tl.constexpr):
        """One token: its whole row of dLoss/dy (B, S, 3 H HD, contiguous) and its partial sums of
        the norm weights' gradients (B * S, HD). dq, dk, dv (B, H, S, HD) at strides s_*b, s_*h,
        s_*s over b, h, s, and 1 over HD."""
        tok, b, s, rows, cols = _token(S, H, HALF)
        src = y_ptr + b * s_yb + s * s_ys
        cos = tl.load(cos_ptr + tok * HALF + cols)                         # (1, HALF)
        sin = tl.load(sin_ptr + tok * HALF + cols)
        dst = dy_ptr + tok * 3 * H * HD
        _bwd_rows(src, dq_ptr + b * s_qb + s * s_qs + rows * s_qh, dst, wq_ptr, dwq_ptr + tok * HD,
                  cos, sin, eps, rows, cols, HALF, HD, NORM)
        _bwd_rows(src + H * HD, dk_ptr + b * s_kb + s * s_ks + rows * s_kh, dst + H * HD, wk_ptr,
                  dwk_ptr + tok * HD, cos, sin, eps, rows, cols, HALF, HD, NORM)
        full = tl.arange(0, HD)[None, :]
        tl.store(dst + 2 * H * HD + rows * HD + full,
                 tl.load(dv_ptr + b * s_vb + s * s_vs + rows * s_vh + full))


def _dims(y: Tensor, heads: int) -> tuple[int, int, int, int]:
    B, S, D3 = y.shape
    torch._check(D3 % (3 * heads) == 0 and y.stride(2) == 1,
                 lambda: f"qkv_prepare: y must be (B, S, 3 * heads * head_dim) with contiguous "
                         f"rows, got {tuple(y.shape)} strides {y.stride()} for {heads} heads")
    return B, S, heads, D3 // (3 * heads)


@triton_op("elephant::qkv_prepare", mutates_args=())
def _fwd_op(y: Tensor, cos: Tensor, sin: Tensor, wq: Tensor | None, wk: Tensor | None, eps: float,
            heads: int) -> tuple[Tensor, Tensor, Tensor]:
    B, S, H, hd = _dims(y, heads)
    q, k, v = (torch.empty(B, S, H, hd, device=y.device, dtype=y.dtype).transpose(1, 2)
               for _ in range(3))                                       # (B, H, S, hd) views
    norm = wq is not None
    if B * S:
        torch.library.wrap_triton(_qkv_fwd_kernel)[(B * S,)](
            y, cos.contiguous(), sin.contiguous(), wq if norm else cos, wk if norm else cos,
            q, k, v, S, y.stride(0), y.stride(1), eps, H=H, HD=hd, HALF=hd // 2, NORM=norm,
            num_warps=1 if _INTERPRET else 2)
    return q, k, v


@triton_op("elephant::qkv_prepare_backward", mutates_args=())
def _bwd_op(y: Tensor, cos: Tensor, sin: Tensor, wq: Tensor | None, wk: Tensor | None,
            dq: Tensor, dk: Tensor, dv: Tensor, eps: float, heads: int
            ) -> tuple[Tensor, Tensor, Tensor]:
    B, S, H, hd = _dims(y, heads)
    norm = wq is not None
    dy = torch.empty(B, S, 3 * H * hd, device=y.device, dtype=y.dtype)
    f32 = dict(device=y.device, dtype=torch.float32)
    dwq, dwk = (torch.empty(B * S if norm else 1, hd, **f32) for _ in range(2))
    # any strides over b, h, s; a gradient strided over hd (which none of attention's paths
    # makes) is copied, so that the kernel's row loads stay contiguous
    dq, dk, dv = (g if g.stride(3) == 1 else g.contiguous() for g in (dq, dk, dv))
    if B * S:
        torch.library.wrap_triton(_qkv_bwd_kernel)[(B * S,)](
            y, cos.contiguous(), sin.contiguous(), wq if norm else cos, wk if norm else cos,
            dq, dk, dv, dy, dwq, dwk, S, y.stride(0), y.stride(1),
            dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2), eps, H=H, HD=hd, HALF=hd // 2, NORM=norm,
            num_warps=1 if _INTERPRET else 2)
    return dy, dwq.sum(0), dwk.sum(0)


def _setup(ctx, inputs, output):
    y, cos, sin, wq, wk, eps, heads = inputs
    ctx.save_for_backward(y, cos, sin, wq, wk)
    ctx.eps, ctx.heads = eps, heads


def _grad(ctx, dq, dk, dv):
    y, cos, sin, wq, wk = ctx.saved_tensors
    dy, dwq, dwk = _bwd_op(y, cos, sin, wq, wk, dq, dk, dv, ctx.eps, ctx.heads)
    if wq is None:
        return dy, None, None, None, None, None, None
    return dy, None, None, dwq.to(wq.dtype), dwk.to(wk.dtype), None, None


register_autograd(_fwd_op, _grad, setup_context=_setup)


def qkv_prepare(y: Tensor, cos: Tensor, sin: Tensor, wq: Tensor | None, wk: Tensor | None,
                eps: float, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """q and k normalized (with wq / wk) and rotated, and v, each (B, H, S, hd) in y's dtype, from
    the qkv projection's output y (B, S, 3 * heads * hd); cos / sin (B, S, hd / 2) float32.
    Each output is a view of (B, S, H, hd) storage: `q.transpose(1, 2)` is contiguous; their
    gradients may come at any strides (unit stride over hd read without a copy)."""
    torch._check((wq is None) == (wk is None),
                 lambda: "qkv_prepare: give both norm weights or none")
    return _fwd_op(y, cos.float(), sin.float(), None if wq is None else wq.float(),
                   None if wk is None else wk.float(), float(eps), heads)
