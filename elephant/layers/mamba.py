"""The Mamba-2 mixer (Dao & Gu 2024, https://arxiv.org/abs/2405.21060) with its state passed in and out.

    x -> in_proj -> [z | xBC | dt]
    xBC -> causal depthwise conv (sees the carried conv state as its previous d_conv - 1 inputs) -> SiLU
        -> [x | B | C] -> SSD scan from the carried SSM state (ssd.ssd_scan) -> y
    y -> gated RMSNorm: rmsnorm(y * silu(z)) * weight -> out_proj

The state is an explicit argument, never hidden in the module: `forward(x, conv_state, ssm_state)`
returns `(y, new_conv_state, new_ssm_state)`, so feeding a sequence in chunks of any lengths with the
carried state is the same as one pass over the whole sequence, and gradients flow into both incoming
states (training backpropagates through a few chunks). The conv state holds the last d_conv - 1 xBC
inputs before activation and keeps the dtype it came in (init_state's dtype); the SSM state is float32
(float64 for fp64 models).

Packed documents: with `seg` (B, L) segment ids (0 = the carried document), the conv never mixes
inputs of two segments (an explicit shifted sum over the d_conv taps with a same-segment mask) and
the scan restarts at each boundary (ssd_scan's `seg`). A segment > 0 starts from zero conv inputs and
a zero SSM state, or from `init = (conv_tail (conv_dim, d_conv - 1), ssm_init (H, P, N))` when given
(the model's initial-memory prefix). The returned state is the last segment's. The scan takes
ssm_init itself (ssd_scan's `segment_init`); `fused_segment_init = False` on a mixer takes the older
path instead, a zero-restarting scan plus `add_segment_init` (the same result; kept for the
benchmark's breakdown).

On CUDA the conv is the Triton kernel of `conv_triton` (channels last, reading the carried inputs in
place, segments and `tail` included; `fast_conv = False` takes the PyTorch forms above, which stay
the reference). The Triton scan takes the activated conv output whole (ssd_scan's `joint`) and
writes the gradients of its x, B and C blocks into one tensor, which the conv's backward kernels
read, times SiLU', as it is: no concatenation of the three and no SiLU-backward pass between them
(`joint_grad = False`: three gradients, concatenated by autograd). On that path the whole block
between the two projections is one op (`mamba_inner`, `fused_inner`), whose backward writes the
in-projection's gradient [dz | dxBC | ddt] in place instead of autograd concatenating the three.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from elephant.config import ModelConfig
from elephant.layers import conv_triton, mamba_inner, norm_triton
from elephant.layers.ssd import add_segment_init, ssd_scan


class GatedRMSNorm(nn.Module):
    """rmsnorm(y * silu(z)) * weight, computed in float32 (Mamba-2's norm_before_gate=False).
    On CUDA its backward is one Triton kernel (`norm_triton`; `fused = False` keeps autograd's
    backward of the same ops, the reference)."""

    def __init__(self, dim: int, eps: float, fused: bool = True):
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self.fused and y.is_cuda and norm_triton.supported(y, z):
            return norm_triton.gated_rmsnorm(y, z, self.weight, self.eps)
        return norm_triton.reference(y, z, self.weight, self.eps)


def segment_conv(window: torch.Tensor, seg: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                 tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise conv that does not mix segments: window (B, C, K-1+L) = [carried inputs
    (segment 0) | this chunk's inputs], seg (B, L) nondecreasing, weight (C, 1, K), bias (C,). A tap
    that would read an earlier segment reads zero, or the matching input of `tail` (C, K-1) (the
    inputs a segment > 0 starts after). Returns the conv output (B, C, L) and the last segment's conv
    state (B, C, K-1), both in window's dtype.

    An explicit sum over the K taps, accumulated in float32 (float64 for fp64) as a conv kernel
    does: elementwise, it compiles into one kernel, and each output holds only its own segment's
    inputs. What `tail` adds depends only on how far a token is into its segment (d < K-1), so it is
    formed once per channel, r (C, K-1), and added under K-1 masks: no per-token indexing, whose
    backward would scatter into the tail (`segment_conv_reference` is the indexing form)."""
    B, C, W = window.shape
    K = weight.shape[-1]
    L = W - (K - 1)
    acc = torch.promote_types(window.dtype, torch.float32)
    w = weight.to(acc).view(C, K)
    seg_w = torch.cat([seg.new_zeros(B, K - 1), seg], dim=1)                  # (B, K-1+L)
    since = conv_triton.segment_since(seg)                                    # tokens into the segment
    out = bias.to(acc)[None, :, None].expand(B, C, L)
    for s in range(K):  # tap K-1-s reads the input s tokens back, if it is in the same segment
        same = (seg_w[:, K - 1 - s: W - s] == seg)[:, None]                   # (B, 1, L)
        out = out + w[:, K - 1 - s, None] * torch.where(same, window[:, :, K - 1 - s: W - s].to(acc), 0.0)
    if tail is not None:
        # a token d < K-1 tokens into a segment > 0 reads, through taps s > d, tail[K-1-s+d]:
        # r[:, d] = sum_{s > d} w[:, K-1-s] tail[:, K-1-s+d]
        t = tail.to(window.dtype).to(acc)
        inner = seg > 0
        for d in range(K - 1):
            r = sum(w[:, K - 1 - s] * t[:, K - 1 - s + d] for s in range(d + 1, K))   # (C,)
            first = (inner & (since == d))[:, None]                           # (B, 1, L)
            out = out + torch.where(first, r[:, None], 0.0)
    # the state after the chunk: the last K-1 inputs, as the last segment sees them
    state = conv_triton.last_segment_state(window[:, :, L:], seg_w[:, L:], seg, since, tail)
    return out.to(window.dtype), state


def segment_conv_reference(window: torch.Tensor, seg: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor, tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`segment_conv` written the plain way, the reference the tests hold it equal to: each tap
    that would read an earlier segment reads the matching input of `tail` by indexing it per token.
    (On GPU that indexing is slow: its backward scatters every token's gradient into the C x (K-1)
    tail with atomic adds, nearly all to one address per channel.)"""
    B, C, W = window.shape
    K = weight.shape[-1]
    L = W - (K - 1)
    w = weight.to(window.dtype).view(C, K)
    idx = torch.arange(L, device=seg.device)
    seg_w = torch.cat([seg.new_zeros(B, K - 1), seg], dim=1)                  # (B, K-1+L)
    is_start = seg_w[:, K - 1:] != seg_w[:, K - 2:-1] if K > 1 else torch.zeros_like(seg, dtype=torch.bool)
    first = torch.where(is_start, idx, 0).cummax(1).values                   # (B, L) segment starts
    since = idx - first                                                       # tokens since that start
    out = bias.to(window.dtype)[None, :, None].expand(B, C, L)
    for s in range(K):  # tap K-1-s reads the input s tokens back
        xs = window[:, :, K - 1 - s: W - s]                                   # (B, C, L)
        same = (seg_w[:, K - 1 - s: W - s] == seg)[:, None]                   # (B, 1, L)
        if tail is None:
            v = torch.where(same, xs, 0.0)
        else:  # s - since tokens before the segment's start: tail input K-1-(s - since)
            j = (K - 1 - s + since).clamp(0, K - 2)                           # (B, L)
            v = torch.where(same, xs, tail.to(window.dtype)[:, j].permute(1, 0, 2))
        out = out + w[:, K - 1 - s, None] * v
    # the state after the chunk: the last K-1 inputs, as the last segment sees them
    last = window[:, :, L:]                                                   # (B, C, K-1)
    same = (seg_w[:, L:] == seg[:, -1:])[:, None]
    if tail is None:
        state = torch.where(same, last, 0.0)
    else:
        j = (torch.arange(K - 1, device=seg.device) + since[:, -1:] + 1).clamp(max=K - 2)  # (B, K-1)
        state = torch.where(same, last, tail.to(window.dtype)[:, j].permute(1, 0, 2))
    return out, state


def short_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               seg: torch.Tensor | None = None, tail: torch.Tensor | None = None,
               fast: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixers' causal depthwise conv and its SiLU: x (B, L, C) this chunk's inputs, conv_state
    (B, C, K-1) the carried ones, weight (C, 1, K), bias (C,); seg (B, L) segment ids and `tail`
    (C, K-1) the inputs a segment > 0 starts after (see `segment_conv`). Returns silu(conv) (B, L,
    C) in x's dtype and the conv state after the chunk (B, C, K-1) in conv_state's dtype (so that
    a state keeps its dtype from chunk to chunk). On CUDA (with `fast`) the Triton conv, reading
    [carried inputs | this chunk] in place, channels last; else conv1d, or `segment_conv`."""
    if fast and x.is_cuda and conv_triton.supported(x):
        return conv_triton.depthwise_conv(x, conv_state, weight, bias, seg, tail, silu=True)
    K = weight.shape[-1]
    window = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=2)   # (B, C, K-1+L)
    if seg is None:
        new_conv_state = window[:, :, window.shape[2] - (K - 1):].to(conv_state.dtype)
        out = F.conv1d(window, weight.to(window.dtype), bias.to(window.dtype),
                       groups=window.shape[1])                                  # (B, C, L)
    else:
        out, new_conv_state = segment_conv(window, seg, weight, bias, tail)
        new_conv_state = new_conv_state.to(conv_state.dtype)
    return F.silu(out).transpose(1, 2), new_conv_state


def conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`short_conv` for one token, x (B, C): a dot product over the window [carried inputs | this
    input], accumulated in float32 as a conv kernel does. Returns (silu(conv) (B, C), new state)."""
    window = torch.cat([conv_state.to(x.dtype), x.unsqueeze(2)], dim=2)        # (B, C, K)
    new_conv_state = window[:, :, 1:].to(conv_state.dtype)
    acc = torch.promote_types(window.dtype, torch.float32)
    w = weight.to(acc)[:, 0]                                                     # (C, K)
    out = ((window.to(acc) * w).sum(-1) + bias.to(acc)).to(window.dtype)
    return F.silu(out), new_conv_state


def decay_parameters(heads: int, dt_min: float, dt_max: float, dt_floor: float,
                     A_range: tuple[float, float]) -> tuple[nn.Parameter, nn.Parameter]:
    """Per-head (dt_bias, A_log) of Mamba-2's decay, exp(-exp(A_log) softplus(raw + dt_bias)) a
    step, at their initialisation (also the delta rule's, layers/delta.py): dt = softplus(raw +
    dt_bias) starts log-uniform in [dt_min, dt_max] (dt_bias = softplus^-1(dt)), and A = -exp(A_log)
    uniform in -A_range."""
    dt = torch.exp(torch.rand(heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=dt_floor)
    dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
    A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(*A_range)))
    return dt_bias, A_log


class Mamba2(nn.Module):
    fused_segment_init = True  # False: the scan restarts from zero and add_segment_init adds ssm_init
    fast_conv = True           # on CUDA, the Triton conv (conv_triton); False: conv1d / segment_conv
    joint_grad = True          # the Triton scan returns x's, B's and C's gradients as one tensor
    # the conv, scan and gated norm as one op whose backward writes the in-projection's gradient
    # whole (mamba_inner): None on CUDA where the Triton path runs, True wherever its kernels run
    # (the CPU tests, under the interpreter), False never
    fused_inner: bool | None = None

    def __init__(self, cfg: ModelConfig, dt_min: float = 1e-3, dt_max: float = 1e-1,
                 dt_floor: float = 1e-4, A_range: tuple[float, float] = (1.0, 16.0)):
        super().__init__()
        self.d_model = cfg.d_model
        self.d_inner = cfg.d_inner
        self.d_state = cfg.d_state
        self.head_dim = cfg.mamba_head_dim
        self.heads = cfg.mamba_heads
        self.d_conv = cfg.d_conv
        self.chunk_size = cfg.ssd_chunk
        self.conv_dim = self.d_inner + 2 * self.d_state
        if self.heads * self.head_dim != self.d_inner:
            raise ValueError(f"model.mamba_head_dim={self.head_dim} must divide expand * d_model = "
                             f"{self.d_inner}")

        # layout of the in-projection's output: [z | x | B | C | dt]
        self.in_proj = nn.Linear(self.d_model, 2 * self.d_inner + 2 * self.d_state + self.heads,
                                 bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.d_conv, groups=self.conv_dim,
                                bias=True)
        self.dt_bias, self.A_log = decay_parameters(self.heads, dt_min, dt_max, dt_floor, A_range)
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GatedRMSNorm(self.d_inner, cfg.norm_eps)
        self.out_proj = nn.Linear(self.d_inner, self.d_model, bias=False)
        nn.init.normal_(self.in_proj.weight, std=cfg.init_std)
        nn.init.normal_(self.out_proj.weight, std=cfg.init_std)
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True

    def init_state(self, batch: int, device=None, dtype=torch.float32):
        """Zero (conv_state (batch, conv_dim, d_conv - 1) in dtype, ssm_state (batch, heads, head_dim,
        d_state) in float32, or float64 when dtype is float64)."""
        conv_state = torch.zeros(batch, self.conv_dim, self.d_conv - 1, device=device, dtype=dtype)
        ssm_state = torch.zeros(batch, self.heads, self.head_dim, self.d_state, device=device,
                                dtype=torch.promote_types(dtype, torch.float32))
        return conv_state, ssm_state

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                seg: torch.Tensor | None = None, init: tuple | None = None):
        """x (B, L, d_model) -> (y (B, L, d_model), new conv_state, new ssm_state); any L >= 1.
        seg (B, L) segment ids of packed documents, init the state segments > 0 start from (see
        the module docstring)."""
        b, l, _ = x.shape
        zxbcdt = self.in_proj(x)
        if self._takes_inner(zxbcdt, seg, init):
            out, new_conv_state, new_ssm_state = mamba_inner.mamba_inner(
                zxbcdt, conv_state, self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log,
                self.D, self.norm.weight, ssm_state, self._dims(), self.norm.eps, seg, init)
            return self.out_proj(out), new_conv_state.contiguous(), new_ssm_state.contiguous()
        z, xBC, dt = zxbcdt.split([self.d_inner, self.conv_dim, self.heads], dim=-1)
        tail = None if seg is None or init is None else init[0]
        xBC, new_conv_state = short_conv(xBC, conv_state, self.conv1d.weight, self.conv1d.bias,
                                         seg, tail, fast=self.fast_conv)          # (B, L, conv_dim)
        return self._after_conv(xBC, z, dt, ssm_state, seg, init, b, l, new_conv_state)

    def _dims(self) -> list[int]:
        return [self.d_inner, self.conv_dim, self.heads, self.head_dim, self.d_state,
                self.chunk_size]

    def _takes_inner(self, zxbcdt: torch.Tensor, seg, init) -> bool:
        """Whether forward takes `mamba_inner` (see fused_inner): the path it fuses is the one the
        chunk would take (the Triton conv and scan, the joint gradient, the fused segment
        initial state, the norm's kernel)."""
        if self.fused_inner is False or not (self.fast_conv and self.joint_grad and self.norm.fused
                                             and (init is None or self.fused_segment_init)):
            return False
        return mamba_inner.takes(zxbcdt, self.conv1d.weight, self._dims(), self.d_conv,
                                 anywhere=bool(self.fused_inner))

    def _after_conv(self, xBC, z, dt, ssm_state, seg, init, b, l, new_conv_state):
        """forward from the activated conv output xBC (B, L, conv_dim) on: the scan and the gated
        norm, the out-projection."""
        xs, Bm, Cm = xBC.split([self.d_inner, self.d_state, self.d_state], dim=-1)

        fdt = torch.promote_types(dt.dtype, torch.float32)  # float32, or float64 for fp64 models
        dt = F.softplus(dt.to(fdt) + self.dt_bias.to(fdt))                        # (B, L, H)
        A = -torch.exp(self.A_log.to(fdt))
        ssm_init = None if seg is None or init is None else init[1]  # segments > 0 start from it
        fused = ssm_init is not None and self.fused_segment_init
        y, new_ssm_state = ssd_scan(
            xs.reshape(b, l, self.heads, self.head_dim), dt, A,
            Bm.reshape(b, l, 1, self.d_state), Cm.reshape(b, l, 1, self.d_state),
            self.D, ssm_state, chunk_size=self.chunk_size, seg=seg,
            segment_init=ssm_init if fused else None,
            joint=xBC if self.joint_grad else None)                                # y (B, L, H, P)
        if ssm_init is not None and not fused:
            y, new_ssm_state = add_segment_init(y, new_ssm_state, dt, A, Cm.reshape(b, l, 1, self.d_state),
                                                seg, ssm_init, self.chunk_size)
        y = self.norm(y.reshape(b, l, self.d_inner), z)
        # contiguous: the conv state is the tail of the conv's window (a view of it), and a state
        # with other strides than a fresh one is a new compile of a compiled chunk
        return self.out_proj(y), new_conv_state.contiguous(), new_ssm_state.contiguous()

    def step(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor):
        """One token: x (B, d_model) -> (y (B, d_model), new conv_state, new ssm_state).

        The recurrent form of `forward` for decoding (the same result as forward on a (B, 1, D)
        input, without the chunked scan): the conv is a dot product over the window [carried
        inputs | this input] and the SSM state advances by s = exp(dt A) s + dt x B^T, y = s C + D x.
        """
        b = x.shape[0]
        zxbcdt = self.in_proj(x)
        z, xBC, dt = zxbcdt.split([self.d_inner, self.conv_dim, self.heads], dim=-1)
        xBC, new_conv_state = conv_step(xBC, conv_state, self.conv1d.weight, self.conv1d.bias)
        xs, Bm, Cm = xBC.split([self.d_inner, self.d_state, self.d_state], dim=-1)

        cdt = ssm_state.dtype                        # float32, or float64 for fp64 models
        fdt = torch.promote_types(dt.dtype, torch.float32)
        dt = F.softplus(dt.to(fdt) + self.dt_bias.to(fdt)).to(cdt)                 # (B, H)
        A = -torch.exp(self.A_log.to(fdt)).to(cdt)
        xh = xs.reshape(b, self.heads, self.head_dim).to(cdt)                      # (B, H, P)
        decay = torch.exp(dt * A)[:, :, None, None]                                # (B, H, 1, 1)
        write = (dt[:, :, None] * xh)[..., None] * Bm.to(cdt)[:, None, None, :]    # (B, H, P, N)
        new_ssm_state = decay * ssm_state + write
        y = torch.einsum("bhpn,bn->bhp", new_ssm_state, Cm.to(cdt)) + self.D.to(cdt)[:, None] * xh
        y = self.norm(y.reshape(b, self.d_inner).to(xs.dtype), z)
        return self.out_proj(y), new_conv_state, new_ssm_state
