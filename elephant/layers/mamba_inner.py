"""The Mamba block between its two projections as one op, whose backward writes the in-projection's
gradient as one tensor.

    mamba_inner(zxbcdt, ...) == gated_norm(scan(SiLU(conv(xBC)), softplus(dt + dt_bias)), z)

zxbcdt (B, L, F) is the in-projection's output, column blocks [z | xBC | dt] (`mamba.Mamba2`).
Autograd, given the three blocks as views, concatenates their gradients into the projection's
(B, L, F) gradient: a pass of its own over ~2,200 columns of every token, ~53 us a Mamba layer's
chunk at the wt103-70m shape (0.53 ms of a 45 ms training step), for bytes the kernels had just
written. Here one backward fills that gradient in place: the gated norm's kernel writes dz into
its first columns (`norm_triton.backward_into`), the conv's kernels write dxBC into the next
(`conv_triton.conv_backward(into=)`), and a small kernel writes dt's gradient into the last ones
and adds the carried conv state's gradient to the chunk's last rows.

The forward is the same kernels and PyTorch ops as the separate path (the Triton conv with its
SiLU, the Triton scan with its joint gradient, the norm's PyTorch forward), and the backward the
same kernels, so the two agree but for summation order in the small sums (the CPU tests hold them
equal). What autograd did around them is written out here: the in-chunk cumulative decay's
backward (`ssd_triton.decay_cumsum_backward`), softplus', and the carried conv state's gradient
(the state is the last d_conv - 1 inputs as the last segment sees them: `conv_triton.state_after`).

Registered as torch.library.triton_op (forward and backward), joined by register_autograd, so that
torch.compile traces both bodies and fuses their PyTorch ops (a torch.autograd.Function around
such ops compiled wrongly in float32 here: `norm_triton`'s docstring). Every kernel is given the
whole gradient tensor and a column offset, never a view of it, so that the compiled graph sees
each write the one tensor it allocated and needs no copy. Runs on CUDA, and on CPU tensors under
TRITON_INTERPRET=1 (the tests).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import conv_triton, norm_triton, ssd_triton
from .ssd import takes_triton
from .triton_env import HAS_TRITON, tl, triton
from .triton_env import INTERPRET as _INTERPRET
from .triton_env import register_autograd, triton_op

if HAS_TRITON:
    @triton.jit
    def _into_columns_kernel(src_ptr, dst_ptr, R, W, s_sb, s_sr, s_db, s_dr, dst_off,
                             ADD: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr):
        """dst[b, r, dst_off + c] (+)= src[b, r, c] for r < R, c < W (src's columns at unit
        stride), in float32, stored in dst's dtype."""
        b = tl.program_id(1).to(tl.int64)
        r = (tl.program_id(0) * BR + tl.arange(0, BR))[:, None]
        c = (tl.program_id(2) * BW + tl.arange(0, BW))[None, :]
        m = (r < R) & (c < W)
        v = tl.load(src_ptr + b * s_sb + r * s_sr + c, mask=m, other=0.0).to(tl.float32)
        at = dst_ptr + dst_off + b * s_db + r * s_dr + c
        if ADD:
            v += tl.load(at, mask=m, other=0.0).to(tl.float32)
        tl.store(at, v.to(dst_ptr.dtype.element_ty), mask=m)


def _into_columns(dst: Tensor, src: Tensor, row: int, col: int, add: bool) -> None:
    """dst[:, row:row + R, col:col + W] (+)= src (B, R, W), dst (B, L, F) contiguous."""
    B, R, W = src.shape
    if src.stride(2) != 1:
        src = src.contiguous()
    # tiles of at most 2,048 values (a thread ~16 at 4 warps): the new conv state's gradient is 3
    # rows of ~1,100 columns, dt's 16 columns of every row
    BW = min(triton.next_power_of_2(W), 128)
    BR = min(triton.next_power_of_2(R), 2048 // BW)
    torch.library.wrap_triton(_into_columns_kernel)[(triton.cdiv(R, BR), B, triton.cdiv(W, BW))](
        src, dst, R, W, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        row * dst.stride(1) + col, ADD=add, BR=BR, BW=BW, num_warps=1 if _INTERPRET else 4)


def _blocks(zxbcdt: Tensor, dims: list[int]):
    d_inner, conv_dim = dims[0], dims[1]
    return (zxbcdt[..., :d_inner], zxbcdt[..., d_inner:d_inner + conv_dim],
            zxbcdt[..., d_inner + conv_dim:])


def _scan_inputs(act: Tensor, dims: list[int]):
    """x (b, l, h, p), B and C (b, l, 1, n): views of the activated conv output's column blocks."""
    d_inner, _, heads, head_dim, d_state, _ = dims
    b, l, _ = act.shape
    return (act[..., :d_inner].view(b, l, heads, head_dim),
            act[..., d_inner:d_inner + d_state].view(b, l, 1, d_state),
            act[..., d_inner + d_state:].view(b, l, 1, d_state))


@triton_op("elephant::mamba_inner", mutates_args=())
def _inner_op(zxbcdt: Tensor, conv_state: Tensor, conv_w: Tensor, conv_b: Tensor, dt_bias: Tensor,
              A_log: Tensor, D: Tensor, norm_w: Tensor, ssm_state: Tensor, seg: Optional[Tensor],
              since: Optional[Tensor], tail: Optional[Tensor], sinit: Optional[Tensor],
              dims: list[int], eps: float, mend: bool
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, new conv state, new SSM state) and what the backward reads: the conv's output, its
    SiLU, the scan's y, the states entering its chunks, dt and the cumulative decay.
    dims = [d_inner, conv_dim, heads, head_dim, d_state, scan chunk]."""
    b, l, _ = zxbcdt.shape
    z, xBC, raw = _blocks(zxbcdt, dims)
    act = torch.empty(xBC.shape, device=xBC.device, dtype=xBC.dtype)
    conv_out = conv_triton._conv_fwd(xBC, conv_state, conv_w, conv_b, seg, since, tail, act, mend)
    new_conv = conv_triton.state_after(xBC, conv_state, seg, since, tail)
    dt = F.softplus(raw.float() + dt_bias.float())
    A = -torch.exp(A_log.float())
    cs, segp = ssd_triton.decay_cumsum(dt, A, seg, dims[5])
    x, Bm, Cm = _scan_inputs(act, dims)
    y, final, states = ssd_triton._ssd_op(
        x, dt, cs, segp, Bm, Cm, D, ssm_state.float().contiguous(),
        None if sinit is None else sinit.float().contiguous(), dims[5])
    out = norm_triton.reference(y.view(b, l, dims[0]), z, norm_w, eps)
    return out, new_conv, final, conv_out, act, y, states, dt, cs


@triton_op("elephant::mamba_inner_backward", mutates_args=())
def _inner_bwd_op(dout: Tensor, dconv_new: Optional[Tensor], dfinal: Tensor, zxbcdt: Tensor,
                  conv_state: Tensor, conv_w: Tensor, dt_bias: Tensor, A_log: Tensor, D: Tensor,
                  norm_w: Tensor, ssm_state: Tensor, seg: Optional[Tensor],
                  since: Optional[Tensor], tail: Optional[Tensor], sinit: Optional[Tensor],
                  conv_out: Tensor, act: Tensor, y: Tensor, states: Tensor, dt: Tensor, cs: Tensor,
                  dims: list[int], eps: float, mend: bool
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                             Tensor, Tensor, Tensor]:
    """(dzxbcdt, dconv_state, dconv_w, dconv_b, ddt_bias, dA_log, dD per lane and chunk,
    dnorm_w, dssm_state, dtail, dsinit per lane), float32 but dzxbcdt; dtail and dsinit empty
    without a tail / sinit. dconv_new may be None (the new conv state has no gradient)."""
    d_inner, conv_dim, heads, head_dim, d_state, Q = dims
    b, l, width = zxbcdt.shape
    z, xBC, raw = _blocks(zxbcdt, dims)
    grad = torch.empty(b, l, width, device=zxbcdt.device, dtype=zxbcdt.dtype)
    # the norm: dz into the first columns
    dy, dnorm_w = norm_triton.backward_into(dout, y.view(b, l, d_inner), z, norm_w.float(), eps,
                                            grad)
    # the scan: the gradient of the activated conv output as one tensor, dt's and the decay's
    x, Bm, Cm = _scan_inputs(act, dims)
    segp = None if seg is None else ssd_triton.padded_segments(seg, Q)
    djoint, ddt, dcs, _, dD, dinit, dsinit = ssd_triton._ssd_bwd_op(
        x, dt, cs, segp, Bm, Cm, D, ssm_state.float().contiguous(),
        None if sinit is None else sinit.float().contiguous(), states,
        dy.view(b, l, heads, head_dim), dfinal.float().contiguous(), Q, True)
    # dt = softplus(raw + dt_bias) enters the scan itself and its decay dt * A, A = -exp(A_log)
    A = -torch.exp(A_log.float())
    ddA = ssd_triton.decay_cumsum_backward(dcs, segp, l)
    ddt = ddt + ddA * A
    dA_log = (ddA * dt).sum((0, 1)) * A
    draw = ddt * torch.sigmoid(raw.float() + dt_bias.float())
    # the conv: dxBC (through SiLU') into the next columns
    _, dconv_state, dconv_w, dconv_b, dtail = conv_triton.conv_backward(
        djoint, xBC, conv_state, conv_w, seg, since, tail, mend, conv_out, into=grad,
        col=d_inner)
    _into_columns(grad, draw, 0, d_inner + conv_dim, add=False)
    if dconv_new is not None:
        dtail = _state_after_backward(grad, dconv_new, seg, since, tail, dtail, d_inner)
    empty = dfinal.new_empty(0)
    return (grad, dconv_state, dconv_w, dconv_b, draw.sum((0, 1)), dA_log, dD, dnorm_w, dinit,
            dtail if tail is not None else empty, dsinit if dsinit is not None else empty)


def _state_after_backward(grad: Tensor, dnew: Tensor, seg, since, tail, dtail: Tensor,
                          col: int) -> Tensor:
    """`conv_triton.state_after`'s backward for a chunk of at least K-1 tokens: the new state
    (B, C, K-1) is the chunk's last K-1 inputs where they are the last segment's, else zero or
    the tail's input that segment starts after. Their gradient is added to grad's rows L-K+1 ..
    L-1 at columns col .. col + C; returns dtail with the tail's part added."""
    B, C, K1 = dnew.shape
    L = grad.shape[1]
    d = dnew.float()
    if seg is not None:
        same = (seg[:, L - K1:] == seg[:, -1:])[:, None]                       # (B, 1, K-1)
        if tail is not None:
            j = torch.arange(K1, device=seg.device) + since[:, -1:].long() + 1  # (B, K-1)
            pick = ((j[:, :, None] == torch.arange(K1, device=seg.device))
                    & ~same[:, 0, :, None]).to(d.dtype)                         # (B, K-1, K-1)
            dtail = dtail + torch.einsum("bck,bki->ci", d, pick)
        d = torch.where(same, d, 0.0)
    _into_columns(grad, d.transpose(1, 2), L - K1, col, add=True)
    return dtail


def _setup(ctx, inputs, output):
    (zxbcdt, conv_state, conv_w, conv_b, dt_bias, A_log, D, norm_w, ssm_state, seg, since, tail,
     sinit, dims, eps, mend) = inputs
    _, _, _, conv_out, act, y, states, dt, cs = output
    ctx.save_for_backward(zxbcdt, conv_state, conv_w, dt_bias, A_log, D, norm_w, ssm_state, seg,
                          since, tail, sinit, conv_out, act, y, states, dt, cs)
    ctx.dims, ctx.eps, ctx.mend = dims, eps, mend
    ctx.dtypes = [t.dtype if t is not None else None
                  for t in (conv_state, conv_w, conv_b, dt_bias, A_log, D, norm_w, ssm_state, tail,
                            sinit)]
    ctx.set_materialize_grads(False)   # the outputs kept for the backward get none


def _grad(ctx, dout, dconv_new, dfinal, *_):
    (zxbcdt, conv_state, conv_w, dt_bias, A_log, D, norm_w, ssm_state, seg, since, tail, sinit,
     conv_out, act, y, states, dt, cs) = ctx.saved_tensors
    b, l, _ = zxbcdt.shape
    dims = ctx.dims
    if dout is None:
        dout = torch.zeros(b, l, dims[0], device=zxbcdt.device, dtype=zxbcdt.dtype)
    if dfinal is None:
        dfinal = torch.zeros(b, dims[2], dims[3], dims[4], device=zxbcdt.device,
                             dtype=torch.float32)
    (grad, dstate, dw, db, ddt_bias, dA_log, dD, dnorm_w, dinit, dtail,
     dsinit) = _inner_bwd_op(dout, dconv_new, dfinal, zxbcdt, conv_state, conv_w, dt_bias, A_log,
                             D, norm_w, ssm_state, seg, since, tail, sinit, conv_out, act, y,
                             states, dt, cs, dims, ctx.eps, ctx.mend)
    st, wt, bt, dtt, at, Dt, nt, sst, tt, sit = ctx.dtypes
    return (grad, dstate.to(st), dw.view(conv_w.shape).to(wt), db.to(bt), ddt_bias.to(dtt),
            dA_log.to(at), dD.sum((0, 1)).to(Dt), dnorm_w.to(nt), dinit.to(sst), None, None,
            dtail.to(tt) if tail is not None else None,
            dsinit.sum(0).to(sit) if sinit is not None else None, None, None, None)


register_autograd(_inner_op, _grad, setup_context=_setup)


def mamba_inner(zxbcdt: Tensor, conv_state: Tensor, conv_w: Tensor, conv_b: Tensor,
                dt_bias: Tensor, A_log: Tensor, D: Tensor, norm_w: Tensor, ssm_state: Tensor,
                dims: list[int], eps: float, seg: Tensor | None = None,
                init: tuple | None = None, form: str | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """(the gated norm's output (B, L, d_inner) in zxbcdt's dtype, the new conv state in
    conv_state's dtype, the new SSM state in float32): `Mamba2`'s forward between its
    projections, as the separate Triton path computes it (see the module docstring). `init`: the
    (conv tail, SSM state) that segments > 0 start from, with `seg`. `form`: the conv's segment
    form (conv_triton.SEGMENT_FORM)."""
    tail, sinit = (None, None) if seg is None or init is None else init
    seg, since, tail, mend = conv_triton.segment_args(seg, tail, form)
    out, new_conv, final = _inner_op(zxbcdt, conv_state, conv_w, conv_b, dt_bias, A_log, D,
                                     norm_w, ssm_state, seg, since, tail, sinit, list(dims),
                                     float(eps), mend)[:3]
    return out, new_conv, final


def takes(zxbcdt: Tensor, conv_w: Tensor, dims: list[int], d_conv: int, anywhere: bool) -> bool:
    """Whether the op takes this chunk: the Triton conv, scan and norm run on it (CUDA, or CPU
    under the interpreter, float32/bfloat16/float16), and the chunk has at least d_conv - 1
    tokens (its new conv state then holds only its own inputs); unless `anywhere`, only where the
    separate path's scan takes Triton too (`ssd.takes_triton`: CUDA, the backend, not inlined in a
    graph)."""
    d_inner, conv_dim, heads, head_dim, d_state, Q = dims
    b, l, _ = zxbcdt.shape
    if not (HAS_TRITON and l >= max(1, d_conv - 1) and conv_w.is_contiguous()
            and conv_triton.supported(zxbcdt)):
        return False
    z = zxbcdt[..., :d_inner]
    x = z.unflatten(-1, (heads, head_dim))
    B = z[..., None, :d_state]   # B's shape and dtype, for the checks
    if not (norm_triton.supported(z, z) and ssd_triton.supports(x, B, Q)):
        return False
    return anywhere or (zxbcdt.is_cuda and takes_triton(x, B, Q))
