"""The gated delta rule mixer (Gated DeltaNet: Yang, Kautz & Hatamizadeh 2024,
https://arxiv.org/abs/2412.06464), the `D` layers of ElephantLM, with its state passed in and out.

    x -> in_proj -> [q | k | v | z | b | a]
    [q | k | v] -> causal depthwise conv (carried conv state, as Mamba-2's) -> SiLU
    q, k L2-normalized per head (q also scaled by dk^-0.5), beta = sigmoid(b),
    alpha = exp(-exp(A_log) softplus(a + dt_bias))           (Mamba-2's decay)
    per head a state S (dk, dv), an associative memory from keys to values:
        S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        o_t = S_t^T q_t
    o -> RMS norm per head, times weight and silu(z) -> out_proj

The design choice is the write: where Mamba-2 adds dt x B^T to a decaying state, the delta rule
first takes out what S holds under k_t (S^T k_t) and writes v_t in its place at strength beta_t,
so a key can be overwritten instead of piling up, and a read with that key returns the value
(an associative memory; DeltaNet, Schlag et al. 2021; Yang et al. 2024). With ||k|| = 1 and beta in
(0, 1), I - beta k k^T has eigenvalues in [0, 1]: the recurrence is stable. S is float32 (float64
for fp64 models) and is carried from chunk to chunk like Mamba's SSM state; the conv state like
Mamba's conv state.

Two forms of the rule share one signature, `f(q, k, v, beta, g, initial_state, [chunk_size,] seg,
segment_init) -> (o, final_state)`, g = log alpha:
- `delta_rule_recurrent`: token by token; the ground truth of the tests. Its one token,
  `delta_rule_step`, is the decoder's step (`GatedDeltaNet.step`).
- `delta_rule_chunked`: the chunkwise-parallel form (the WY / UT transform of DeltaNet's chunked
  algorithm, Yang et al. 2024, https://arxiv.org/abs/2406.06484): inside each block of chunk_size
  tokens the writes are found at once by one unit-lower-triangular solve, and only the state
  passes from block to block. Shape-static: a chunk of L tokens is one graph for torch.compile.
- `delta_rule` picks one: the chunked form, or, opted in with `ELEPHANT_DELTA=fla` in the
  environment (read at import) or `set_backend("fla")`, fla-core's Triton kernel
  (`chunk_gated_delta_rule`, `delta_rule_fla`) for CUDA inputs without packed segments
  (tests/test_delta.py holds it equal to the chunked form, on a GPU).

Packed documents: with `seg` (B, L) segment ids (0 = the carried document) the conv never mixes
segments (mamba.short_conv) and S restarts at each boundary, from zero or from `init` =
(conv tail (conv_dim, d_conv - 1), S0 (H, dk, dv)), the initial memory's prefix, exactly as
Mamba2.forward takes them. The returned state is the last segment's.
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from elephant.config import ModelConfig
from elephant.layers.mamba import conv_step, decay_parameters, short_conv
from elephant.layers.ssd import segment_cumsum, segment_masks

BACKENDS = ("torch", "fla")
_backend = os.environ.get("ELEPHANT_DELTA", "torch")


def set_backend(name: str) -> None:
    """The path `delta_rule` takes: "torch" (the chunked form, the default) or "fla" (fla-core's
    kernel on CUDA where it applies; fails at once, in one line, when fla-core does not import)."""
    global _backend
    if _check_backend(name) == "fla":
        _fla_kernel()
    _backend = name


def get_backend() -> str:
    return _check_backend(_backend)


def _check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"ELEPHANT_DELTA / delta.set_backend: expected one of "
                         f"{', '.join(BACKENDS)}, got {name!r}")
    return name


def _fla_kernel():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        raise RuntimeError(f"the fla path of the D layers (ELEPHANT_DELTA=fla) needs fla-core "
                           f"(pip install -e .[fla]): {e}") from None
    return chunk_gated_delta_rule


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 stays float64; every other dtype is computed in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def check_shapes(q, k, v, beta, g, initial_state, seg, segment_init) -> None:
    b, l, h, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != (b, l, h) or beta.shape != (b, l, h) or g.shape != beta.shape:
        raise ValueError(f"delta rule: expected q, k (b, l, h, dk), v (b, l, h, dv), beta and g "
                         f"(b, l, h); got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"beta {tuple(beta.shape)}, g {tuple(g.shape)}")
    if initial_state is not None and initial_state.shape != (b, h, dk, dv):
        raise ValueError(f"delta rule: initial_state must be (b, h, dk, dv) = {(b, h, dk, dv)}, got "
                         f"{tuple(initial_state.shape)}")
    if seg is not None and seg.shape != (b, l):
        raise ValueError(f"delta rule: seg must be (b, l) = {(b, l)}, got {tuple(seg.shape)}")
    if segment_init is not None and (seg is None or segment_init.shape != (h, dk, dv)):
        raise ValueError(f"delta rule: segment_init (h, dk, dv) = {(h, dk, dv)} goes with seg, got "
                         f"{None if segment_init is None else tuple(segment_init.shape)}"
                         f"{' without seg' if seg is None else ''}")


# ------------------------------------------------------------------------------------ the rule
def delta_rule_step(q, k, v, beta, g, state):
    """One token of the rule per head: q, k (b, h, dk), v (b, h, dv), beta, g (b, h), state
    (b, h, dk, dv), all in the compute dtype -> (o (b, h, dv), new state)."""
    kS = torch.einsum("bhk,bhkv->bhv", k, state)                               # what S holds under k
    state = torch.exp(g)[..., None, None] * (state - beta[..., None, None] * k[..., None] * kS[:, :, None])
    state = state + beta[..., None, None] * k[..., None] * v[:, :, None]
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def delta_rule_recurrent(q, k, v, beta, g, initial_state=None, seg=None, segment_init=None):
    """Token by token; the ground truth (O(l) Python steps: tests and the decoder). Shapes: q, k
    (b, l, h, dk), v (b, l, h, dv), beta in (0, 1) and g = log alpha <= 0 (b, l, h), initial_state
    (b, h, dk, dv) or None (zero). With `seg` the state restarts where the segment id changes
    (the token before the first counts as segment 0), from zero or `segment_init` (h, dk, dv).
    Returns o (b, l, h, dv) in v's dtype and the final state in the compute dtype."""
    check_shapes(q, k, v, beta, g, initial_state, seg, segment_init)
    b, l, h, dk = q.shape
    dv = v.shape[-1]
    cdt = compute_dtype(v)
    with torch.autocast(v.device.type, enabled=False):
        q, k, vc, beta, g = (t.to(cdt) for t in (q, k, v, beta, g))
        s = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(cdt)
        restart = 0.0 if segment_init is None else segment_init.to(cdt)
        prev = torch.zeros(b, dtype=torch.long, device=q.device)
        outs = []
        for t in range(l):
            if seg is not None:
                s = torch.where((seg[:, t] != prev)[:, None, None, None], restart, s)
                prev = seg[:, t]
            o, s = delta_rule_step(q[:, t], k[:, t], vc[:, t], beta[:, t], g[:, t], s)
            outs.append(o)
        o = torch.stack(outs, dim=1) if outs else vc.new_zeros(b, 0, h, dv)
    return o.to(v.dtype), s


def delta_rule_chunked(q, k, v, beta, g, initial_state=None, chunk_size: int = 64, seg=None,
                       segment_init=None):
    """The chunkwise-parallel form; `delta_rule_recurrent`'s arguments and results. Any length:
    the tail block is padded with beta = 0 and g = 0 (no write, no decay).

    Per block, with G_t the log decay summed from the block's start (or from the token's segment
    start) and the state X that the token's segment starts from (the incoming S, or S0), write
    S_t = e^{G_t} X + sum_{s <= t} e^{G_t - G_s} k_s u_s^T. The rule's write u_t = beta_t (v_t -
    alpha_t S_{t-1}^T k_t) then solves the unit lower-triangular system (I + A) U = beta V - beta
    e^G K X, A_ts = beta_t e^{G_t - G_s} k_t . k_s (s < t, same segment): U = W_v - W_k X with
    [W_v | W_k] = (I + A)^{-1} [beta V | beta e^G K], found for every block at once (the UT
    transform). Only U's X term and the outputs o_t = e^{G_t} q_t X + sum_{s <= t} e^{G_t - G_s}
    (q_t . k_s) u_s wait for the state, which passes on as S_end = e^{G_end} X + sum_s
    e^{G_end - G_s} k_s u_s^T: a loop over blocks of (Q x dk) @ (dk x dv) products."""
    check_shapes(q, k, v, beta, g, initial_state, seg, segment_init)
    with torch.autocast(v.device.type, enabled=False):
        o, final = _delta_chunked(q, k, v, beta, g, initial_state, chunk_size, seg, segment_init)
    return o, final


def _delta_chunked(q, k, v, beta, g, initial_state, Q, seg, segment_init):
    b, l, h, dk = q.shape
    dv = v.shape[-1]
    cdt = compute_dtype(v)
    nc = max(1, math.ceil(l / Q))
    pad = nc * Q - l
    q, k, vc, beta, g = (t.to(cdt) for t in (q, k, v, beta, g))
    if pad:   # beta = 0: no write; g = 0: no decay
        q, k, vc = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, vc))
        beta, g = (F.pad(t, (0, 0, 0, pad)) for t in (beta, g))
    blocks = lambda t: t.view(b, nc, Q, h, -1).permute(0, 3, 1, 2, 4)   # noqa: E731 (b, h, c, Q, d)
    qc, kc, vb = blocks(q), blocks(k), blocks(vc)
    betac = beta.view(b, nc, Q, h).permute(0, 3, 1, 2)                 # (b, h, c, Q)
    gc = g.view(b, nc, Q, h)
    causal = torch.ones(Q, Q, dtype=torch.bool, device=q.device).tril()
    if seg is None:
        G = gc.cumsum(2)
        same = causal
    else:   # G restarts at each boundary; no term crosses one
        segc, own, incoming, passes = segment_masks(seg, nc, Q)        # (b, c, Q) x3, (b, c)
        G = segment_cumsum(gc, segc)
        same = causal & (segc[..., :, None] == segc[..., None, :])[:, None]   # (b, 1, c, Q, Q)
    G = G.permute(0, 3, 1, 2)                                          # (b, h, c, Q)
    diff = G[..., :, None] - G[..., None, :]                           # (b, h, c, Q, Q): G_t - G_s
    strict = same & ~torch.eye(Q, dtype=torch.bool, device=q.device)
    A = betac[..., None] * (kc @ kc.transpose(-1, -2)) * torch.exp(diff.masked_fill(~strict, -math.inf))
    scores = (qc @ kc.transpose(-1, -2)) * torch.exp(diff.masked_fill(~same, -math.inf))
    eG = torch.exp(G)[..., None]                                       # (b, h, c, Q, 1)
    if seg is None:
        rhs = [betac[..., None] * vb, betac[..., None] * eG * kc]
    else:   # the tokens of the segment entering the block start from the incoming S, others S0
        into = incoming[:, None, ..., None]                           # (b, 1, c, Q, 1)
        eG_in, eG_fresh = eG * into, eG * ~into
        rhs = [betac[..., None] * vb, betac[..., None] * eG_in * kc]
        if segment_init is not None:
            rhs.append(betac[..., None] * eG_fresh * kc)
    eye = torch.eye(Q, dtype=cdt, device=q.device)
    W = torch.linalg.solve_triangular(eye + A, torch.cat(rhs, dim=-1), upper=False,
                                      unitriangular=True)              # (b, h, c, Q, dv + dk [+ dk])
    Wv, Wk = W[..., :dv], W[..., dv:dv + dk]
    q_in = qc * (eG if seg is None else eG_in)
    # the block's end state: G_end - G_s over the block's last segment
    to_end = G[..., -1:] - G
    if seg is not None:
        to_end = to_end.masked_fill(~own[:, None], -math.inf)
    k_end = kc * torch.exp(to_end)[..., None]                          # (b, h, c, Q, dk)
    g_end = torch.exp(G[..., -1])[..., None, None]                     # (b, h, c, 1, 1)
    U0, O0, restart = Wv, None, 0.0
    if seg is not None and segment_init is not None:   # the S0 terms, every block at once
        restart = segment_init.to(cdt)                                 # (h, dk, dv)
        U0 = Wv - W[..., dv + dk:] @ restart[:, None]
        O0 = (qc * eG_fresh) @ restart[:, None]
    s = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(cdt)
    outs = []
    for c in range(nc):
        u = U0[:, :, c] - Wk[:, :, c] @ s                              # (b, h, Q, dv) the writes
        o = q_in[:, :, c] @ s + scores[:, :, c] @ u
        outs.append(o if O0 is None else o + O0[:, :, c])
        if seg is not None:   # a block whose last segment starts inside it carries S0, or zero
            s = torch.where(passes[:, c, None, None, None], s, restart)
        s = g_end[:, :, c] * s + k_end[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2)                                       # (b, h, c, Q, dv)
    o = o.permute(0, 2, 3, 1, 4).reshape(b, nc * Q, h, dv)[:, :l]
    return o.to(v.dtype), s


def delta_rule(q, k, v, beta, g, initial_state=None, chunk_size: int = 64, seg=None,
               segment_init=None):
    """The chunked rule through the backend switch: fla-core's kernel for CUDA inputs of one
    document per lane (no `seg`) when opted in (`set_backend`), else `delta_rule_chunked`."""
    if q.is_cuda and seg is None and get_backend() == "fla":
        return delta_rule_fla(q, k, v, beta, g, initial_state)
    return delta_rule_chunked(q, k, v, beta, g, initial_state, chunk_size, seg, segment_init)


def delta_rule_fla(q, k, v, beta, g, initial_state=None):
    """fla-core's `chunk_gated_delta_rule` with this module's conventions (CUDA only). It takes
    q, k, v in bf16 or fp16 (not float32), g the log decay, the state (b, h, dk, dv) as here,
    and scales q by a factor of its own: 1 here, q comes scaled. Returns o in v's dtype and the
    final state in float32."""
    kernel = _fla_kernel()
    dtype = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    b, _, h, dk = q.shape
    s0 = (torch.zeros(b, h, dk, v.shape[-1], device=q.device, dtype=torch.float32)
          if initial_state is None else initial_state.float())
    o, final = kernel(q.to(dtype), k.to(dtype), v.to(dtype), g.float(), beta.to(dtype), scale=1.0,
                      initial_state=s0, output_final_state=True)
    return o.to(v.dtype), final


# ------------------------------------------------------------------------------------ the mixer
class HeadRMSNormGated(nn.Module):
    """rmsnorm(o) per head (over dv) * weight * silu(z), computed in float32 (Gated DeltaNet's
    output norm: each head's memory read is normalized on its own)."""

    def __init__(self, heads: int, dim: int, eps: float):
        super().__init__()
        self.heads, self.eps = heads, eps
        self.weight = nn.Parameter(torch.ones(heads * dim))

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o (..., H, dv), z (..., H dv) -> (..., H dv) in z's dtype."""
        acc = torch.promote_types(z.dtype, torch.float32)
        o = o.to(acc)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        y = o.flatten(-2) * self.weight.to(acc) * F.silu(z.to(acc))
        return y.to(z.dtype)


class GatedDeltaNet(nn.Module):
    fast_conv = True   # on CUDA, the Triton conv (conv_triton); False: conv1d / segment_conv

    def __init__(self, cfg: ModelConfig, dt_min: float = 1e-3, dt_max: float = 1e-1,
                 dt_floor: float = 1e-4, A_range: tuple[float, float] = (1.0, 16.0)):
        super().__init__()
        self.d_model = cfg.d_model
        self.heads = cfg.n_heads
        self.key_dim = cfg.head_dim
        self.value_dim = cfg.delta_value_dim
        self.d_conv = cfg.d_conv
        self.chunk_size = cfg.ssd_chunk
        H, dk, dv = self.heads, self.key_dim, self.value_dim
        self.conv_dim = H * (2 * dk + dv)                       # the conv runs over [q | k | v]
        # layout of the in-projection's output: [q | k | v | z | b | a]
        self.in_proj = nn.Linear(self.d_model, self.conv_dim + H * dv + 2 * H, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.d_conv, groups=self.conv_dim,
                                bias=True)
        # the decay alpha = exp(-exp(A_log) softplus(a + dt_bias)), Mamba-2's parameterisation and
        # init (dt log-uniform in [dt_min, dt_max], -exp(A_log) in -A_range)
        self.dt_bias, self.A_log = decay_parameters(H, dt_min, dt_max, dt_floor, A_range)
        self.norm = HeadRMSNormGated(H, dv, cfg.norm_eps)
        self.out_proj = nn.Linear(H * dv, self.d_model, bias=False)
        nn.init.normal_(self.in_proj.weight, std=cfg.init_std)
        nn.init.normal_(self.out_proj.weight, std=cfg.init_std)
        for p in (self.dt_bias, self.A_log):
            p._no_weight_decay = True

    def init_state(self, batch: int, device=None, dtype=torch.float32):
        """Zero (conv_state (batch, conv_dim, d_conv - 1) in dtype, S (batch, heads, key_dim,
        value_dim) in float32, or float64 when dtype is float64)."""
        conv_state = torch.zeros(batch, self.conv_dim, self.d_conv - 1, device=device, dtype=dtype)
        state = torch.zeros(batch, self.heads, self.key_dim, self.value_dim, device=device,
                            dtype=torch.promote_types(dtype, torch.float32))
        return conv_state, state

    def _split(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The in-projection's output (..., F) -> [q | k | v] (the conv's input), z, [b | a]."""
        H = self.heads
        return proj.split([self.conv_dim, H * self.value_dim, 2 * H], dim=-1)

    def _rule_inputs(self, qkv: torch.Tensor, ba: torch.Tensor, cdt: torch.dtype):
        """The activated conv output [q | k | v] (..., conv_dim) and [b | a] (..., 2H) -> q, k
        (..., H, dk) L2-normalized (q also times dk^-0.5), v (..., H, dv), beta and g = log alpha
        (..., H), all in the compute dtype cdt."""
        H, dk, dv = self.heads, self.key_dim, self.value_dim
        q, k, v = qkv.split([H * dk, H * dk, H * dv], dim=-1)
        lead = qkv.shape[:-1]
        q = F.normalize(q.reshape(*lead, H, dk).to(cdt), dim=-1) * dk ** -0.5
        k = F.normalize(k.reshape(*lead, H, dk).to(cdt), dim=-1)
        b, a = ba.to(cdt).split([H, H], dim=-1)
        g = -torch.exp(self.A_log.to(cdt)) * F.softplus(a + self.dt_bias.to(cdt))
        return q, k, v.reshape(*lead, H, dv), torch.sigmoid(b), g

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
                seg: torch.Tensor | None = None, init: tuple | None = None):
        """x (B, L, d_model) -> (y (B, L, d_model), new conv_state, new state); any L >= 1. seg
        (B, L) segment ids of packed documents, init the state segments > 0 start from (see the
        module docstring)."""
        qkv, z, ba = self._split(self.in_proj(x))
        tail = None if seg is None or init is None else init[0]
        qkv, new_conv_state = short_conv(qkv, conv_state, self.conv1d.weight, self.conv1d.bias,
                                         seg, tail, fast=self.fast_conv)        # (B, L, conv_dim)
        q, k, v, beta, g = self._rule_inputs(qkv, ba, state.dtype)
        s0 = None if seg is None or init is None else init[1]
        o, new_state = delta_rule(q, k, v, beta, g, state, self.chunk_size, seg, s0)  # o (B, L, H, dv)
        y = self.norm(o, z)
        # contiguous: a carried state with a fresh state's strides (no new compile of a chunk)
        return self.out_proj(y), new_conv_state.contiguous(), new_state.contiguous()

    def step(self, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor):
        """One token: x (B, d_model) -> (y (B, d_model), new conv_state, new state), the recurrent
        form of `forward` for decoding."""
        qkv, z, ba = self._split(self.in_proj(x))
        qkv, new_conv_state = conv_step(qkv, conv_state, self.conv1d.weight, self.conv1d.bias)
        q, k, v, beta, g = self._rule_inputs(qkv, ba, state.dtype)
        o, new_state = delta_rule_step(q, k, v.to(state.dtype), beta, g, state)
        return self.out_proj(self.norm(o.to(v.dtype), z)), new_conv_state, new_state
