"""The elephant activation and the elephant-gated GLU MLP, with a fused forward/backward.

    f(x) = 1 / (1 + |x / a|^d)                (a > 0, d > 0; defaults a = 1, d = 8)
    MLP(h) = down(up(h) * f(gate(h)))

(Elephant activation: Lan & Mahmood, "Elephant Neural Networks", arXiv:2310.01365.)

Why a fused op: autograd through the plain expression keeps five tensors of the MLP's hidden size
per layer (|g/a|, its power, f, u and the product), and its pow backward turns inf * 0 into NaN
once |g/a|^d overflows. `elephant_glu(u, g)` is one op that keeps only u and g and recomputes f in
backward; `glu_down(u, g, W)` goes one step further and also recomputes the product that the down
projection would otherwise keep, so the whole MLP keeps its input, u and g. The MLP makes u and g
by one product (its up and gate weights stacked) and calls `glu_down_cat([u | g], W)`, whose
kernels read the halves in place and write the gradient [du | dg] whole, so that the product's
backward is one matrix product for its input's gradient, not two and an addition.

Derivative, written so that it is finite everywhere (z = |x| / a, f = f(x)):
    f'(x) = -sign(x) * d / a * w,   w = z^(d-1) f^2
    z <= 1:  f = 1 / (1 + z^d),          w = z^(d-1) f^2          (no overflow: z^d <= 1)
    z >  1:  q = z^-d,  f = q / (1 + q),  w = f / ((1 + q) z)      (q <= 1, may underflow to 0)
    x == 0:  f'(0) = 0 (f is even; for d <= 1 the one-sided limits differ and 0 is the
             symmetric derivative).
Everything is computed in float32 (float64 for float64 inputs) and returned in the input's dtype.

Fast path: Triton elementwise kernels on CUDA (they also run on CPU tensors under
TRITON_INTERPRET=1, which is how the CPU tests check them); eager PyTorch elsewhere. Both are
wrapped as `torch.library.custom_op`s, so `torch.compile` treats them as opaque ops without graph
breaks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from elephant.layers import inline_in_graph

# Triton is optional: the eager path needs nothing
from elephant.layers.triton_env import FLOAT_DTYPES as _TRITON_DTYPES
from elephant.layers.triton_env import HAS_TRITON, tl, triton, unit_stride_rows
from elephant.layers.triton_env import check, custom_op, register_autograd


# ------------------------------------------------------------------------------- reference
def elephant_ref(x: Tensor, a: float = 1.0, d: float = 8.0) -> Tensor:
    """The plain autograd expression (its gradient is NaN where |x/a|^d overflows)."""
    return 1.0 / (1.0 + (x / a).abs().pow(d))


def elephant_glu_ref(u: Tensor, g: Tensor, a: float = 1.0, d: float = 8.0) -> Tensor:
    return u * elephant_ref(g, a, d)


# ------------------------------------------------------------------------------- eager math
def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _squarable(e: float) -> bool:
    """Whether _pow takes z ** e by repeated squaring: a whole exponent up to 16 in size."""
    return e == int(e) and 1 <= abs(e) <= 16


def _pow(z: Tensor, e: float) -> Tensor:
    """z ** e; for a whole exponent up to 16 in size (the recipe's d = 8) by repeated squaring: on
    the CPU a general pow costs an exp and a log an element, and was the eager MLP's largest
    kernel in the CPU tests' training loops. Each squaring doubles the relative rounding error,
    so at most ~15 float32 ulps here. A negative exponent: the reciprocal."""
    if not _squarable(e):
        return z.pow(e)
    n, out, base = int(abs(e)), None, z
    while True:
        if n & 1:
            out = base if out is None else out * base
        n >>= 1
        if not n:
            break
        base = base * base
    return out.reciprocal() if e < 0 else out


def _f_eager(g: Tensor, a: float, d: float) -> Tensor:
    g = g.to(_compute_dtype(g))
    return 1.0 / (1.0 + _pow(g.abs() / a, d))  # a power overflowing to inf gives f = 0: fine forward


def _f_df_eager(g: Tensor, a: float, d: float) -> tuple[Tensor, Tensor]:
    """f(g) and f'(g) in the compute dtype, by the stable split of the module docstring."""
    g = g.to(_compute_dtype(g))
    z = g.abs() / a
    small = z <= 1.0
    p = _pow(z, d)          # used only where z <= 1
    # used only where z > 1; by squaring, _pow(z, -d) is p's reciprocal: the same bits, once
    q = p.reciprocal() if _squarable(d) else z.pow(-d)
    f = torch.where(small, 1.0 / (1.0 + p), q / (1.0 + q))
    w = torch.where(small, _pow(z, d - 1.0) * f * f, f / ((1.0 + q) * z))
    w = torch.where(g == 0, torch.zeros_like(w), w)
    return f, -torch.sign(g) * (d / a) * w


# ------------------------------------------------------------------------------- Triton kernels
if HAS_TRITON:
    @triton.jit
    def _f_tl(g, inv_a, d):
        z = tl.abs(g) * inv_a
        lz = tl.log2(z)                       # -inf at 0 -> z^d = 0, f = 1
        return 1.0 / (1.0 + tl.exp2(d * lz))  # z^d overflowing to inf gives f = 0

    @triton.jit
    def _f_df_tl(g, inv_a, d):
        z = tl.abs(g) * inv_a
        lz = tl.log2(z)
        small = z <= 1.0
        p = tl.exp2(d * lz)
        q = tl.exp2(-d * lz)
        f = tl.where(small, 1.0 / (1.0 + p), q / (1.0 + q))
        w = tl.where(small, tl.exp2((d - 1.0) * lz) * f * f, f / ((1.0 + q) * z))
        w = tl.where(g == 0.0, 0.0, w)
        sgn = tl.where(g < 0.0, -1.0, 1.0)
        return f, -sgn * d * inv_a * w

    @triton.jit
    def _fwd_kernel(u_ptr, g_ptr, y_ptr, n, inv_a, d, HAS_U: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        y = _f_tl(g, inv_a, d)
        if HAS_U:
            y = y * tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _bwd_kernel(dy_ptr, u_ptr, g_ptr, du_ptr, dg_ptr, n, inv_a, d,
                    HAS_U: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        f, df = _f_df_tl(g, inv_a, d)
        if HAS_U:
            u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(du_ptr + offs, (dy * f).to(du_ptr.dtype.element_ty), mask=m)
            dy = dy * u
        tl.store(dg_ptr + offs, (dy * df).to(dg_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _glu_cat_fwd_kernel(ug_ptr, y_ptr, n, s_ug, inv_a, d, F: tl.constexpr,
                            BLOCK: tl.constexpr):
        """y = u * f(g) for rows [u | g] of ug (row stride s_ug, F columns each half); y (n / F,
        F) contiguous."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        src = ug_ptr + (offs // F) * s_ug + offs % F
        u = tl.load(src, mask=m, other=0.0).to(tl.float32)
        g = tl.load(src + F, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, (u * _f_tl(g, inv_a, d)).to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _glu_cat_bwd_kernel(dy_ptr, ug_ptr, dug_ptr, n, s_ug, inv_a, d, F: tl.constexpr,
                            BLOCK: tl.constexpr):
        """[du | dg] rows of dug (contiguous, 2F columns) from dy (n / F, F) contiguous and the
        rows [u | g] of ug (row stride s_ug)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        row, col = offs // F, offs % F
        src = ug_ptr + row * s_ug + col
        u = tl.load(src, mask=m, other=0.0).to(tl.float32)
        g = tl.load(src + F, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
        f, df = _f_df_tl(g, inv_a, d)
        dst = dug_ptr + row * (2 * F) + col
        tl.store(dst, (dy * f).to(dug_ptr.dtype.element_ty), mask=m)
        tl.store(dst + F, (dy * u * df).to(dug_ptr.dtype.element_ty), mask=m)

_BLOCK = 1024


def _grid(n: int):
    return (triton.cdiv(n, _BLOCK),)


def forward_triton(u: Tensor | None, g: Tensor, a: float, d: float) -> Tensor:
    """u * f(g) (or f(g) when u is None) by the Triton kernel; any device under TRITON_INTERPRET."""
    g = g.contiguous()
    has_u = u is not None
    u = u.contiguous() if has_u else g
    y = torch.empty(g.shape, dtype=u.dtype, device=g.device)
    n = g.numel()
    if n:
        _fwd_kernel[_grid(n)](u, g, y, n, 1.0 / a, float(d), HAS_U=has_u, BLOCK=_BLOCK,
                              num_warps=4)
    return y


def backward_triton(dy: Tensor, u: Tensor | None, g: Tensor, a: float, d: float
                    ) -> tuple[Tensor | None, Tensor]:
    """(du, dg) of forward_triton by the Triton kernel."""
    dy, g = dy.contiguous(), g.contiguous()
    has_u = u is not None
    u = u.contiguous() if has_u else g
    du = torch.empty(u.shape, dtype=u.dtype, device=g.device) if has_u else None
    dg = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    n = g.numel()
    if n:
        _bwd_kernel[_grid(n)](dy, u, g, du if has_u else dg, dg, n, 1.0 / a, float(d),
                              HAS_U=has_u, BLOCK=_BLOCK, num_warps=4)
    return du, dg


def _use_triton(t: Tensor) -> bool:
    return HAS_TRITON and t.is_cuda and t.dtype in _TRITON_DTYPES


def forward_cat_triton(ug: Tensor, a: float, d: float) -> Tensor:
    """u * f(g) for ug = [u | g] along the last dimension, read in place, by the Triton kernel."""
    rows = unit_stride_rows(ug)
    F2 = ug.shape[-1] // 2
    y = torch.empty(*ug.shape[:-1], F2, dtype=ug.dtype, device=ug.device)
    n = y.numel()
    if n:
        _glu_cat_fwd_kernel[_grid(n)](rows, y, n, rows.stride(0), 1.0 / a, float(d), F=F2,
                                      BLOCK=_BLOCK, num_warps=4)
    return y


def backward_cat_triton(dy: Tensor, ug: Tensor, a: float, d: float) -> Tensor:
    """The gradient [du | dg] (ug's shape, contiguous) of forward_cat_triton."""
    rows = unit_stride_rows(ug)
    F2 = ug.shape[-1] // 2
    dy = dy.contiguous()
    dug = torch.empty(ug.shape, dtype=ug.dtype, device=ug.device)
    n = dy.numel()
    if n:
        _glu_cat_bwd_kernel[_grid(n)](dy, rows, dug, n, rows.stride(0), 1.0 / a, float(d),
                                      F=F2, BLOCK=_BLOCK, num_warps=4)
    return dug


# ------------------------------------------------------------------------------- the ops
def _forward(u: Tensor | None, g: Tensor, a: float, d: float) -> Tensor:
    if _use_triton(g):
        return forward_triton(u, g, a, d)
    f = _f_eager(g, a, d)
    out_dtype = g.dtype if u is None else u.dtype
    y = f if u is None else u.to(f.dtype) * f
    return y.to(out_dtype).contiguous()


def _backward(dy: Tensor, u: Tensor | None, g: Tensor, a: float, d: float
              ) -> tuple[Tensor | None, Tensor]:
    if _use_triton(g):
        return backward_triton(dy, u, g, a, d)
    f, df = _f_df_eager(g, a, d)
    dy = dy.to(f.dtype)
    if u is None:
        return None, (dy * df).to(g.dtype).contiguous()
    du = (dy * f).to(u.dtype).contiguous()
    dg = (dy * u.to(f.dtype) * df).to(g.dtype).contiguous()
    return du, dg


def _check_glu(u: Tensor, g: Tensor) -> None:
    check(u.shape == g.shape, lambda: f"elephant_glu: u {tuple(u.shape)} and g "
                                      f"{tuple(g.shape)} must have the same shape")
    check(u.dtype == g.dtype, lambda: f"elephant_glu: u ({u.dtype}) and g ({g.dtype}) "
                                      f"must have the same dtype")


@custom_op("elephant::act", mutates_args=())
def _act_op(x: Tensor, a: float, d: float) -> Tensor:
    return _forward(None, x, a, d)


@_act_op.register_fake
def _(x, a, d):
    return x.new_empty(x.shape)


@custom_op("elephant::act_backward", mutates_args=())
def _act_bwd_op(dy: Tensor, x: Tensor, a: float, d: float) -> Tensor:
    return _backward(dy, None, x, a, d)[1]


@_act_bwd_op.register_fake
def _(dy, x, a, d):
    return x.new_empty(x.shape)


def _act_setup(ctx, inputs, output):
    x, a, d = inputs
    ctx.save_for_backward(x)
    ctx.a, ctx.d = a, d


def _act_grad(ctx, dy):
    (x,) = ctx.saved_tensors
    return _act_bwd_op(dy, x, ctx.a, ctx.d), None, None


register_autograd(_act_op, _act_grad, setup_context=_act_setup)


@custom_op("elephant::glu", mutates_args=())
def _glu_op(u: Tensor, g: Tensor, a: float, d: float) -> Tensor:
    _check_glu(u, g)
    return _forward(u, g, a, d)


@_glu_op.register_fake
def _(u, g, a, d):
    _check_glu(u, g)
    return u.new_empty(u.shape)


@custom_op("elephant::glu_backward", mutates_args=())
def _glu_bwd_op(dy: Tensor, u: Tensor, g: Tensor, a: float, d: float) -> tuple[Tensor, Tensor]:
    return _backward(dy, u, g, a, d)


@_glu_bwd_op.register_fake
def _(dy, u, g, a, d):
    return u.new_empty(u.shape), g.new_empty(g.shape)


def _glu_setup(ctx, inputs, output):
    u, g, a, d = inputs
    ctx.save_for_backward(u, g)
    ctx.a, ctx.d = a, d


def _glu_grad(ctx, dy):
    u, g = ctx.saved_tensors
    du, dg = _glu_bwd_op(dy, u, g, ctx.a, ctx.d)
    return du, dg, None, None


register_autograd(_glu_op, _glu_grad, setup_context=_glu_setup)


def _split(ug: Tensor) -> tuple[Tensor, Tensor]:
    F2 = ug.shape[-1] // 2
    return ug[..., :F2], ug[..., F2:]


def _check_cat(ug: Tensor) -> None:
    check(ug.shape[-1] % 2 == 0,
          lambda: f"glu_down_cat: [u | g]'s last dimension {ug.shape[-1]} must be even")


@custom_op("elephant::glu_cat", mutates_args=())
def _glu_cat_op(ug: Tensor, a: float, d: float) -> Tensor:
    _check_cat(ug)
    if _use_triton(ug):
        return forward_cat_triton(ug, a, d)
    return _forward(*_split(ug), a, d)


@_glu_cat_op.register_fake
def _(ug, a, d):
    _check_cat(ug)
    return ug.new_empty(*ug.shape[:-1], ug.shape[-1] // 2)


@custom_op("elephant::glu_cat_backward", mutates_args=())
def _glu_cat_bwd_op(dy: Tensor, ug: Tensor, a: float, d: float) -> Tensor:
    if _use_triton(ug):
        return backward_cat_triton(dy, ug, a, d)
    return torch.cat(_backward(dy, *_split(ug), a, d), dim=-1)


@_glu_cat_bwd_op.register_fake
def _(dy, ug, a, d):
    return ug.new_empty(ug.shape)


def elephant(x: Tensor, a: float = 1.0, d: float = 8.0) -> Tensor:
    """f(x), fused: keeps only x for backward and recomputes f there."""
    return _act_op(x, float(a), float(d))


def elephant_glu(u: Tensor, g: Tensor, a: float = 1.0, d: float = 8.0) -> Tensor:
    """u * f(g), fused: keeps only u and g for backward (same shape and dtype)."""
    return _glu_op(u, g, float(a), float(d))


def _down_grads(dy: Tensor, h: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """The backward of y = F.linear(h, weight) in h's dtype: (dh (..., d_mlp), dweight in
    weight's dtype)."""
    dy = dy.to(h.dtype)
    dh = dy @ weight.to(h.dtype)
    dw = dy.reshape(-1, dy.shape[-1]).t() @ h.reshape(-1, h.shape[-1])  # (d_model, d_mlp)
    return dh, dw.to(weight.dtype)


class _GLUDown(torch.autograd.Function):
    """y = (u * f(g)) @ W^T keeping u, g (and W); the product is recomputed in backward."""

    @staticmethod
    def forward(ctx, u: Tensor, g: Tensor, weight: Tensor, a: float, d: float) -> Tensor:
        h = _glu_op(u, g, a, d)
        ctx.save_for_backward(u, g, weight)
        ctx.a, ctx.d = a, d
        return F.linear(h, weight.to(h.dtype))

    @staticmethod
    def backward(ctx, dy: Tensor):
        u, g, weight = ctx.saved_tensors
        h = _glu_op(u, g, ctx.a, ctx.d)                               # (..., d_mlp) recomputed
        dh, dw = _down_grads(dy, h, weight)
        du, dg = _glu_bwd_op(dh, u, g, ctx.a, ctx.d)
        return du, dg, dw, None, None


def glu_down(u: Tensor, g: Tensor, weight: Tensor, a: float = 1.0, d: float = 8.0) -> Tensor:
    """down(u * f(g)) with down = F.linear(., weight), keeping only u and g for backward."""
    return _GLUDown.apply(u, g, weight, float(a), float(d))


class _GLUDownCat(torch.autograd.Function):
    """`_GLUDown` for ug = [u | g] in one tensor (one product made both): keeps ug (and W); its
    gradient is one [du | dg] tensor, which the product's backward takes whole."""

    @staticmethod
    def forward(ctx, ug: Tensor, weight: Tensor, a: float, d: float) -> Tensor:
        h = _glu_cat_op(ug, a, d)
        ctx.save_for_backward(ug, weight)
        ctx.a, ctx.d = a, d
        return F.linear(h, weight.to(h.dtype))

    @staticmethod
    def backward(ctx, dy: Tensor):
        ug, weight = ctx.saved_tensors
        h = _glu_cat_op(ug, ctx.a, ctx.d)                             # (..., d_mlp) recomputed
        dh, dw = _down_grads(dy, h, weight)
        return _glu_cat_bwd_op(dh, ug, ctx.a, ctx.d), dw, None, None


def glu_down_cat(ug: Tensor, weight: Tensor, a: float = 1.0, d: float = 8.0) -> Tensor:
    """down(u * f(g)) for ug = [u | g] along the last dimension (F.linear(., weight) as down),
    keeping only ug for backward."""
    return _GLUDownCat.apply(ug, weight, float(a), float(d))


# ------------------------------------------------------------------------------- the MLP
class ElephantMLP(nn.Module):
    """down(up(h) * f(gate(h))), no biases.

    `fused=True` (default) uses `glu_down` (keeps h, u, g per layer), on CUDA with u and g made
    by one product and `glu_down_cat` (`one_product`), except for a few tokens inside a compiled
    graph (`inline_in_graph`); `fused=False` is the plain autograd reference.
    Initialization: normal(cfg.init_std) for every weight here; the model's own `reset_parameters`
    rescales `down` (a residual output) by name. `reset_parameters(std, out_std)` does both
    explicitly.
    """

    def __init__(self, cfg, fused: bool = True):
        super().__init__()
        self.a, self.d = float(cfg.elephant_a), float(cfg.elephant_d)
        self.fused = fused
        # u and g by one product (glu_down_cat): None, on CUDA, where the GLU's kernels read
        # [u | g] in place (on the CPU the eager GLU gains nothing from it and pays a concatenation
        # of the gradients: a CPU training test ran 8% longer)
        self.one_product: bool | None = None
        self.up = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)
        self.gate = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)
        self.down = nn.Linear(cfg.d_mlp, cfg.d_model, bias=False)
        self.reset_parameters(cfg.init_std, cfg.init_std)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        nn.init.normal_(self.up.weight, std=std)
        nn.init.normal_(self.gate.weight, std=std)
        nn.init.normal_(self.down.weight, std=std if out_std is None else out_std)

    def forward(self, h: Tensor) -> Tensor:
        fused = self.fused and not inline_in_graph(h, h.numel() // h.shape[-1])
        if fused and (h.is_cuda if self.one_product is None else self.one_product):
            # up and gate as one product (their weights stacked: one pass over h, and in the
            # backward one product for h's gradient over [du | dg], which the kernel writes whole)
            ug = F.linear(h, torch.cat([self.up.weight, self.gate.weight]))   # (B, T, 2 d_mlp)
            return glu_down_cat(ug, self.down.weight, self.a, self.d)
        u, g = self.up(h), self.gate(h)                                # (B, T, d_mlp) each
        if fused:
            return glu_down(u, g, self.down.weight, self.a, self.d)
        return self.down(elephant_glu_ref(u, g, self.a, self.d))
