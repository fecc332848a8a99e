"""Causal attention over [cached K/V of the lane | this chunk], with rotary positions per lane.

    Attention(cfg)(x, pos, cache_k=None, cache_v=None, cache_valid=None) -> (y, k, v)

Every query of the chunk sees the valid slots of its lane's cache (keys and values of earlier
chunks, rotated with their own absolute positions, carrying no gradient) and the keys j <= i of
the chunk. Rotary angles come from `pos` (B, S), so positions run on per lane across chunks and a
cached key keeps its position; a negative position means "not rotated" (memory tokens). With kept
tokens (model.kv_keep, `kept=`), the layer's kept keys/values join the window as one cache (the
invalid slots of both moved to its front, `with_kept_first`): rotated at a position just before the
window (so at the same distance from the chunk however old they are), values scaled by
sigmoid(keep score) (`Attention.kept_tokens`). Where a query reads only its best kv_keep_read of
more kept tokens (`reads_some_kept`): in training (a gradient recorded) and for packed documents,
[kept | window] under a mask per head and query (`kept_top`); at inference, in two parts merged by
log-sum-exp, [window | chunk] by the kernel below and each query's best kept tokens apart
(`attend_top_kept`, layers/kept_read.py): no mask, each kept key scored once. With `free`
(mem_rotary "free"), every query scores the memory tokens' keys without rotary (`free_scores`:
one kernel call on doubled head dims).

Which kernel: the mask that a chunk needs over [cache | chunk] is lower-right causal plus a per-lane
validity mask of the cache, which a flash kernel takes only as variable-length sequences. So:
  * no cache:     SDPA with is_causal=True (flash / cuDNN on GPU);
  * with a cache whose valid slots are a suffix of the window (KVCache's invariant; with kept
                  tokens, `with_kept_first`'s), on CUDA in 16 bits, where q and v have one head
                  dim (not position-free memory): FlashAttention-2's variable-length kernel, no mask
                  (`attend_varlen`, see VARLEN);
  * otherwise with a cache: SDPA with the explicit boolean mask (B, 1, S, W + S) (`masked_sdpa`:
                  on GPU the keys padded to a multiple of KEY_ALIGN; also the reference path,
                  forward and backward on CPU), or FlexAttention with a block mask
                  (`backend="flex"`, CUDA + torch.compile; no CPU backward).
Shapes depend only on (B, S, W), never on how many cache slots are valid, so torch.compile
compiles once.

Packed documents (`seg` (B, S): segment ids, 0 = the lane's carried document): a query sees the keys
of its own segment (causally), the cache only when it is in segment 0, and the optional `prefix` K/V
(M keys shared by all lanes: the initial memory's, with gradient) only when it is in a later segment,
i.e. a document that started inside the chunk (`attend_segments`): on CUDA in 16 bits, when the caller
knows that few enough documents start inside the chunk (`room`, see SEGMENT_ROOM), FlashAttention-2's
variable-length kernel over a sequence per document (`attend_segments_varlen`); otherwise one
explicit boolean mask over [prefix | cache | chunk] through SDPA, whatever the backend.
`benchmarks/kernels.py layers` times the two cache paths; the default is `ELEPHANT_ATTN` from the
environment (sdpa | flex | reference), else sdpa.
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import assoc, rotary_triton
from .kept_read import masked_attention_lse, merge_by_lse, top_kept_read
from .triton_env import custom_op, register_autograd

BACKENDS = ("sdpa", "flex", "reference")
DEFAULT_BACKEND = os.environ.get("ELEPHANT_ATTN", "sdpa")


# ------------------------------------------------------------------------------- rotary
def inverse_frequencies(head_dim: int, base: float, max_period: float = 0.0, device=None) -> Tensor:
    """base^(-2i / head_dim) (head_dim / 2,) float64; with max_period > 0 the frequencies whose
    period 2 pi / f is longer are 0 (those pairs are not rotated)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    if max_period > 0:
        inv_freq = torch.where(2 * torch.pi / inv_freq > max_period, 0.0, inv_freq)
    return inv_freq


def rotary_cos_sin(pos: Tensor, head_dim: int, base: float, dtype: torch.dtype,
                   max_period: float = 0.0) -> tuple[Tensor, Tensor]:
    """cos, sin (B, 1, S, head_dim / 2) of the rotary angles pos * base^(-2i / head_dim) (pairs of
    a period over `max_period` > 0 not rotated, see inverse_frequencies).

    Angles are formed in float64 (a few hundred thousand elements) so that positions in the
    millions keep their fraction; a negative position gives cos = 1, sin = 0 (no rotation).
    """
    inv_freq = inverse_frequencies(head_dim, base, max_period, pos.device)  # (hd/2,)
    angle = pos.clamp(min=0).to(torch.float64).unsqueeze(-1) * inv_freq  # (B, S, hd/2)
    rotate = (pos >= 0).unsqueeze(-1)
    cos = torch.where(rotate, angle.cos(), 1.0).to(dtype)
    sin = torch.where(rotate, angle.sin(), 0.0).to(dtype)
    return cos.unsqueeze(1), sin.unsqueeze(1)


def rotate_at(x: Tensor, pos: Tensor, base: float, max_period: float = 0.0) -> Tensor:
    """x (B, H, n, hd) rotated to the signed positions pos (B,), the same for every entry of a
    lane (the kept tokens, see Attention.kept_tokens); formed in float64 like rotary_cos_sin."""
    inv_freq = inverse_frequencies(x.shape[-1], base, max_period, x.device)
    angle = pos.to(torch.float64)[:, None, None, None] * inv_freq        # (B, 1, 1, hd/2)
    work = torch.promote_types(x.dtype, torch.float32)
    return apply_rotary(x.to(work), angle.cos().to(work), angle.sin().to(work)).to(x.dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half rotary: pairs (x[i], x[i + hd/2]) turn by the angle of frequency i."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ------------------------------------------------------------------------------- kernels
def attention_mask(S: int, cache_valid: Tensor | None, device=None) -> Tensor:
    """Boolean mask (B, 1, S, W + S) over [cache | chunk]: valid cache slots, then causal.

    Without a cache: (1, 1, S, S) causal. The diagonal is always true, so no query row is empty.
    cache_valid (B, H, S, W), what each head's each query sees of the cache (`kept_top`): the
    mask is (B, H, S, W + S).
    """
    device = cache_valid.device if cache_valid is not None else device
    causal = torch.ones(S, S, dtype=torch.bool, device=device).tril()  # (S, S)
    if cache_valid is None:
        return causal[None, None]
    if cache_valid.dim() == 4:
        B, H = cache_valid.shape[:2]
        return torch.cat([cache_valid, causal.expand(B, H, S, S)], dim=-1)
    B, W = cache_valid.shape
    return torch.cat([cache_valid[:, None, None, :].expand(B, 1, S, W),
                      causal.expand(B, 1, S, S)], dim=-1)


# On CUDA, a masked SDPA call gets its keys padded to a multiple of this many (masked-out zero keys):
# the fused kernels read the mask as an additive bias whose rows must be aligned, and an unaligned
# bias is copied out per call (inside a compiled graph, per head). 0: no padding (ELEPHANT_KEY_ALIGN
# from the environment, for the benchmarks' before/after).
KEY_ALIGN = int(os.environ.get("ELEPHANT_KEY_ALIGN", 16))


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, align: int | None = None) -> Tensor:
    """SDPA of q (B, H, S, hd) over k, v (B, H, n, hd) under the boolean mask (B or 1, 1 or H, S, n).
    `align` (default: KEY_ALIGN on CUDA, none elsewhere): the keys are padded with zero keys that
    no query sees up to a multiple of it. The result is the same: a masked key adds exp(-inf) = 0."""
    n = k.shape[2]
    align = (KEY_ALIGN if q.is_cuda else 0) if align is None else align
    pad = -n % align if align else 0
    if pad:   # keys and values each padded in their own head dim (position-free memory doubles q/k's)
        k = torch.cat([k, k.new_zeros(*k.shape[:2], pad, k.shape[3])], dim=2)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], pad, v.shape[3])], dim=2)
        mask = torch.cat([mask, mask.new_zeros(*mask.shape[:-1], pad)], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# ------------------------------------------------------------------------------- variable length
# On CUDA in 16 bits, a chunk's attention over [cache | chunk] whose valid cache slots are a suffix of
# each lane's window (what KVCache keeps: slots fill from the end, a new document empties them) runs
# as FlashAttention-2's variable-length kernel with no mask at all: per lane two sequences of the
# flattened [cache | chunk] keys, first the invalid slots with no queries, then the lane's S queries
# over [valid slots | chunk], whose causal form is aligned to the last key (lower right), i.e.
# every valid slot and the chunk's keys j <= i. The masked SDPA it replaces reads a (B, S, W + S)
# mask and computes every masked tile (1.01 ms against 0.61 forward and backward at the recipe's
# shape, benchmarks/kernels.py attention-paths). ELEPHANT_ATTN_VARLEN=0: the masked path (A/B).
VARLEN = os.environ.get("ELEPHANT_ATTN_VARLEN", "1") != "0"
# At inference, a layer that reads only some of its kept tokens reads them apart from the window
# and merges the two by log-sum-exp (`attend_top_kept`); ELEPHANT_KEPT_TWO_PART=0: the masked
# path instead (the benchmarks' A/B, and a fallback until the GPU has measured it)
KEPT_TWO_PART = os.environ.get("ELEPHANT_KEPT_TWO_PART", "1") != "0"


def varlen_supported(q: Tensor, v: Tensor) -> bool:
    """Whether `attend_varlen` runs for queries q and values v (CUDA, 16-bit, one head dim that
    FlashAttention takes: not the doubled query and key dims of position-free memory)."""
    return (VARLEN and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
            and torch.backends.cuda.is_flash_attention_available())


def varlen_bounds(n_valid: Tensor, S: int, W: int) -> tuple[Tensor, Tensor]:
    """cu_q, cu_k (2B + 1,) int32 of the sequences `attend_varlen` runs: for lane b, its W - n_valid[b]
    invalid slots with no queries, then its S queries over [its n_valid[b] valid slots | chunk]
    (keys flattened lane by lane as [cache (W) | chunk (S)], queries as S per lane)."""
    B = n_valid.shape[0]
    L = W + S
    lane = torch.arange(B, device=n_valid.device)
    k_starts = torch.stack([lane * L, lane * L + W - n_valid.to(lane.dtype)], 1).flatten()
    q_starts = (lane * S).repeat_interleave(2)
    end = torch.full((1,), B, dtype=lane.dtype, device=lane.device)  # no host copy: graph-safe
    return (torch.cat([q_starts, end * S]).to(torch.int32),
            torch.cat([k_starts, end * L]).to(torch.int32))


@custom_op("elephant::flash_varlen", mutates_args=())
def _varlen_op(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
               scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FlashAttention-2 varlen, causal (lower right per sequence): (out, logsumexp, and the two
    tensors its backward takes back). q (total_q, H, hd), k, v (total_k, H, hd)."""
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, True, False,
        scale=scale)
    return out, lse, rng, unused


@_varlen_op.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)   # its meta shapes
    return out, lse, rng, unused


@custom_op("elephant::flash_varlen_backward", mutates_args=())
def _varlen_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, rng: Tensor, unused: Tensor,
                   scale: float) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out, lse, cu_q, cu_k,
        max_q, max_k, 0.0, True, rng, unused, scale=scale)
    return dq, dk, dv


@_varlen_bwd_op.register_fake
def _(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, rng, unused, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale = inputs
    out, lse, rng, unused = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng, unused)
    ctx.args = (max_q, max_k, scale)


def _varlen_grad(ctx, dout, dlse, drng, dunused):
    q, k, v, out, lse, cu_q, cu_k, rng, unused = ctx.saved_tensors
    max_q, max_k, scale = ctx.args
    dq, dk, dv = _varlen_bwd_op(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, rng, unused, scale)
    return dq, dk, dv, None, None, None, None, None


register_autograd(_varlen_op, _varlen_grad, setup_context=_varlen_setup)


def flash_varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
                 max_k: int, scale: float) -> Tensor:
    """The kernel `attend_varlen` calls (a custom op with its backward, so torch.compile and CUDA
    graphs take it whole); (total_q, H, hd)."""
    return _varlen_op(q, k, v, cu_q, cu_k, max_q, max_k, scale)[0]


def flash_varlen_lse(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
                     max_k: int, scale: float) -> tuple[Tensor, Tensor]:
    """`flash_varlen` with each query's log-sum-exp of its scaled scores: (out (total_q, H, hd),
    lse (H, total_q) float32, FlashAttention-2's unpadded layout). No gradient reaches the
    log-sum-exp (inference: the two-part kept read, `attend_top_kept`)."""
    out, lse, _, _ = _varlen_op(q, k, v, cu_q, cu_k, max_q, max_k, scale)
    return out, lse


def attend_varlen(q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor,
                  cache_valid: Tensor, kernel=None, lse: bool = False):
    """Attention over [cache | chunk] as `attend_reference`, for a cache whose valid slots are a
    suffix of each lane's window (cache_valid (B, W), not checked: KVCache's invariant), by
    variable-length sequences (see VARLEN). q, k, v (B, H, S, hd) -> (B, H, S, hd), a view of
    (B, S, H, hd) rows (the layer's output projection reads them as they are). `kernel`: the
    varlen attention (default `flash_varlen`, looked up at the call: the CPU tests replace it by a
    reference). `lse`: also each query's log-sum-exp (B, H, S) float32 (the kernel then default
    `flash_varlen_lse`, returning (out, lse (H, B * S), or FlashAttention's older padded
    (2B, H, S)))."""
    B, H, S, hd = q.shape
    W = cache_k.shape[2]
    Q = q.transpose(1, 2).reshape(B * S, H, hd)
    K = torch.cat([cache_k.to(k.dtype).transpose(1, 2), k.transpose(1, 2)], 1).reshape(B * (W + S), H, hd)
    V = torch.cat([cache_v.to(v.dtype).transpose(1, 2), v.transpose(1, 2)], 1).reshape(B * (W + S), H, hd)
    cu_q, cu_k = varlen_bounds(cache_valid.sum(1), S, W)
    if lse:
        out, lse = (kernel or flash_varlen_lse)(Q, K, V, cu_q, cu_k, S, W + S, 1.0 / math.sqrt(hd))
        if lse.dim() == 3:   # FlashAttention before 2.6: (sequences, H, max_q), lane b's queries
            lse = lse.view(B, 2, H, -1)[:, 1, :, :S]                    # in its sequence 2b + 1
        else:                # queries flattened lane by lane: (H, B * S) -> (B, H, S)
            lse = lse.view(H, B, S).transpose(0, 1)
        return out.view(B, S, H, hd).transpose(1, 2), lse
    out = (kernel or flash_varlen)(Q, K, V, cu_q, cu_k, S, W + S, 1.0 / math.sqrt(hd))
    return out.view(B, S, H, hd).transpose(1, 2)


def _with_cache(k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor) -> tuple[Tensor, Tensor]:
    # (B, H, W + S, hd); Attention.forward has detached the window (the kept tokens' values keep
    # the gradient of their keep score)
    K = torch.cat([cache_k.to(k.dtype), k], dim=2)
    V = torch.cat([cache_v.to(v.dtype), v], dim=2)
    return K, V


def attend_reference(q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor | None = None,
                     cache_v: Tensor | None = None, cache_valid: Tensor | None = None) -> Tensor:
    """SDPA with the explicit boolean mask. q, k, v (B, H, S, hd) -> (B, H, S, hd)."""
    mask = attention_mask(q.shape[2], cache_valid, q.device)
    if cache_k is not None:
        k, v = _with_cache(k, v, cache_k, cache_v)
    return masked_sdpa(q, k, v, mask)


_compiled_flex = None


def attend_flex(q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor,
                cache_valid: Tensor, compiled: bool = True) -> Tensor:
    """FlexAttention with a block mask over [cache | chunk] (compiled; CUDA for backward)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    B, H, S, hd = q.shape
    W = cache_valid.shape[1]
    K, V = _with_cache(k, v, cache_k, cache_v)
    kv_valid = torch.cat([cache_valid, cache_valid.new_ones(B, S)], dim=1)  # (B, W + S)

    def mask_mod(b, h, qi, kj):
        # a cache slot (kj < W) has kj - W < 0 <= qi: only its validity counts
        return kv_valid[b, kj] & (kj - W <= qi)

    inside = torch.compiler.is_compiling()  # the caller's torch.compile compiles both
    block_mask = create_block_mask(mask_mod, B, None, S, W + S, device=q.device,
                                   _compile=compiled and not inside)
    if inside or not compiled:
        return flex_attention(q, K, V, block_mask=block_mask)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, K, V, block_mask=block_mask)


def attend(q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor | None = None,
           cache_v: Tensor | None = None, cache_valid: Tensor | None = None,
           backend: str = "sdpa", valid_suffix: bool = False) -> Tensor:
    """The fast path: is_causal SDPA without a cache, else the backend's kernel: for sdpa, the
    variable-length kernel where it runs and the cache's valid slots are a suffix of each lane's
    window (`valid_suffix`: the caller's promise), else SDPA with the explicit mask. A cache
    validity per head and query (B, H, S, W) (`kept_top`) always takes the explicit mask."""
    if backend == "reference" or (cache_valid is not None and cache_valid.dim() == 4):
        return attend_reference(q, k, v, cache_k, cache_v, cache_valid)
    if cache_k is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if backend == "flex":
        return attend_flex(q, k, v, cache_k, cache_v, cache_valid)
    if valid_suffix and varlen_supported(q, v):
        return attend_varlen(q, k, v, cache_k, cache_v, cache_valid)
    return attend_reference(q, k, v, cache_k, cache_v, cache_valid)


def attend_lse(q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor,
               cache_valid: Tensor, backend: str = "sdpa") -> tuple[Tensor, Tensor]:
    """Attention over [cache | chunk] as `attend` for a cache whose valid slots are a suffix of each
    lane's window (KVCache's), with each query's log-sum-exp of its scaled scores: (out (B, H, S,
    dv), lse (B, H, S) float32 or 64). Part 1 of the two-part kept read (`attend_top_kept`). For
    sdpa, the variable-length kernel where it runs, position-free memory's values padded with
    zeros to the doubled head dims of q and k (FlashAttention takes one head dim; the zero half
    of its output is dropped); else written out (`kept_read.masked_attention_lse`, the
    reference)."""
    dv = v.shape[-1]
    if backend == "sdpa" and dv <= q.shape[-1] and varlen_supported(q, q):
        pad = q.shape[-1] - dv
        if pad:
            v, cache_v = F.pad(v, (0, pad)), F.pad(cache_v, (0, pad))
        out, lse = attend_varlen(q, k, v, cache_k, cache_v, cache_valid, lse=True)
        return out[..., :dv], lse
    K, V = _with_cache(k, v, cache_k, cache_v)
    return masked_attention_lse(q, K, V, attention_mask(q.shape[2], cache_valid))


def attend_top_kept(q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor,
                    cache_valid: Tensor, q_kept: Tensor, kept_k: Tensor, kept_v: Tensor,
                    kept_valid: Tensor, read: int, backend: str = "sdpa") -> Tensor:
    """Each query over [its `read` best kept tokens | window | chunk], in two parts merged by
    log-sum-exp (layers/kept_read.py): `attend_lse` over [window | chunk] (q, k (B, H, S, dk) as
    the kernel scores them: position-free memory's doubled form too; v (B, H, S, hd); the window
    cache_k/v (B, H, W, .), cache_valid (B, W) a suffix per lane), and `top_kept_read` of the kept
    tokens kept_k, kept_v (B, H, K, hd), kept_valid (B, K), scored by the rotated queries q_kept
    (B, H, S, hd) at 1 / sqrt(hd), as the masked path scores them. -> (B, H, S, hd). What
    `kept_top` and the masked path compute, without their (B, H, S, K + W) mask and with each
    kept key scored once; no gradient through part 1's log-sum-exp on the GPU (inference)."""
    o1, lse1 = attend_lse(q, k, v, cache_k, cache_v, cache_valid, backend)
    o2, lse2 = top_kept_read(q_kept, kept_k, kept_v, kept_valid, read,
                             1.0 / math.sqrt(q_kept.shape[-1]))
    return merge_by_lse(o1, lse1, o2, lse2)


def attend_segments(q: Tensor, k: Tensor, v: Tensor, seg: Tensor, cache_k: Tensor | None = None,
                    cache_v: Tensor | None = None, cache_valid: Tensor | None = None,
                    prefix_k: Tensor | None = None, prefix_v: Tensor | None = None,
                    room: int = 0, layouts: dict | None = None) -> Tensor:
    """Attention masked by document: q, k, v (B, H, S, hd), seg (B, S) nondecreasing segment ids;
    prefix_k/v (1 or B, H, M, hd) seen by segments > 0, the cache by segment 0. -> (B, H, S, hd).
    `room` > 0: the caller's promise that the cache's valid slots are a suffix of each lane's window
    and that at most `room` documents start inside the chunk; then the variable-length kernel where
    it runs (`attend_segments_varlen`; `layouts`: see there), else SDPA with the explicit mask
    (always for a cache validity per head and query (B, H, S, W), `kept_top`)."""
    per_query = cache_valid is not None and cache_valid.dim() == 4
    if (room and not per_query and varlen_supported(q, v)
            and (prefix_k is None or prefix_k.shape[0] == 1)):
        return attend_segments_varlen(q, k, v, seg, room, cache_k, cache_v, cache_valid, prefix_k,
                                      prefix_v, layouts=layouts)
    B, H, S, hd = q.shape
    Hm = H if per_query else 1
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    keys, values = [k], [v]
    masks = [(causal & (seg[:, :, None] == seg[:, None, :]))[:, None]]     # (B, 1, S, S)
    if cache_k is not None:
        K, V = _with_cache(k, v, cache_k, cache_v)
        keys, values = [K], [V]
        seen = cache_valid if per_query else cache_valid[:, None, None, :]
        masks.insert(0, seen & (seg == 0)[:, None, :, None])              # (B, Hm, S, W)
    if prefix_k is not None:
        keys.insert(0, prefix_k.to(k.dtype).expand(B, -1, -1, -1))
        values.insert(0, prefix_v.to(v.dtype).expand(B, -1, -1, -1))
        masks.insert(0, (seg > 0)[:, None, :, None].expand(B, 1, S, prefix_k.shape[2]))
    mask = torch.cat([m.expand(B, Hm, S, m.shape[-1]) for m in masks], dim=-1)  # (B, Hm, S, M + W + S)
    K, V = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    return masked_sdpa(q, K, V, mask)


# ------------------------------------------------------------------------------- packed, variable length
# A packed chunk's attention by the same variable-length kernel: a sequence per document of each lane,
# whose keys are gathered into a layout where each sequence's keys are contiguous and its queries'
# causal form is aligned to its last key: the lane's first document (segment 0) over [its valid window
# slots | its tokens], every later one over [the initial memory's prefix | its tokens] (a copy of the
# M prefix keys before each). The number of sequences must be fixed for a compiled graph, so the layout
# has room for SEGMENT_ROOM documents starting inside the chunk per lane on average (summed over the
# lanes: `room`); the unused sequences are empty, and the unused key rows (invalid window slots, unused
# prefix copies) are left to the last sequences, which have no queries and at most max_k keys. The
# caller counts the starts on the host and passes room = 0 (the masked path) for a chunk that has more
# (ElephantLM.forward). The gradient of the gathered keys goes back by gathers too (`_GatherRows`):
# index_select's own backward, a scatter-add over the whole layout, made the packed step slower than
# the mask (H100, two runs, the unpacked step ~48 ms in each: 55.7 ms; then 53.3 with the mask and
# 52.5 with the gathers in one run).
SEGMENT_ROOM = 2


def segment_room(lanes: int, inner_starts: int | None) -> int:
    """The room of the variable-length layout for a chunk of `lanes` lanes with `inner_starts`
    documents starting inside it (counted on the host; None: unknown), or 0 when it does not fit."""
    room = SEGMENT_ROOM * lanes
    return room if inner_starts is not None and inner_starts <= room else 0


def segment_layout(seg: Tensor, n_valid: Tensor, W: int, M: int, room: int) -> tuple[Tensor, ...]:
    """Where `attend_segments_varlen` puts every key, and its bounds.

    seg (B, S) nondecreasing segment ids from 0 (every lane starts with segment 0, and segment s + 1
    follows s); n_valid (B,) the valid (last) slots of each lane's window of W; M prefix keys; room >=
    the number of segments s > 0 over all lanes (not checked). The keys are gathered from the rows
    [window (B * W) | chunk (B * S) | prefix (M) | a zero row] into total = B * (W + S) + room * M
    rows. Returns idx (total,) the source row of each; tok_row (B * S,) the row of each chunk key;
    win_row (B * W,) the row of each window slot (`total` for an invalid one, gathered nowhere);
    pre_row (room * M,) the rows of the prefix copies (room of them, the unused ones at rows 0..M-1)
    and pre_used (room,) which are used; cu_q, cu_k (n + 1,) int32 of n sequences over the B * S
    queries in lane order, none longer than max(W, M) + S keys."""
    B, S = seg.shape
    dev = seg.device
    t = torch.arange(S, device=dev)
    lane = torch.arange(B, device=dev)[:, None]                                   # (B, 1)
    nv = n_valid.long()[:, None]                                                  # (B, 1)
    extra = seg[:, -1:]                                                           # (B, 1) segments > 0
    keys = nv + S + extra * M                                                     # (B, 1) keys a lane gathers
    key_off = keys.cumsum(0) - keys                                               # (B, 1) its first row
    seq_off = (extra + 1).cumsum(0) - (extra + 1)                                 # (B, 1) its first sequence
    total = B * (W + S) + room * M
    max_k = max(W, M) + S
    # the documents, then empty sequences (room left) and sequences without queries over the unused
    # rows, max_k at most each (at most B * W + room * M rows are unused)
    n_seq = B + room + -(-(B * W + room * M) // max_k)
    first = torch.ones_like(seg, dtype=torch.bool)
    first[:, 1:] = seg[:, 1:] != seg[:, :-1]                     # (B, S) a document's first token
    tok_row = key_off + nv + t + seg * M                          # (B, S) where a token's key goes
    # the prefix copies, one per document starting inside the chunk, in lane order
    later = first & (seg > 0)
    rank = torch.where(later.flatten(), later.flatten().cumsum(0) - 1, room)      # (B * S,), dump: room
    pre_base = torch.zeros(room + 1, dtype=torch.long, device=dev)
    pre_base.scatter_(0, rank, (tok_row - M).flatten())
    pre_used = torch.arange(room, device=dev) < later.sum()                      # (room,)
    pre_row = (pre_base[:room, None] + torch.arange(M, device=dev)).flatten()    # (room * M,)
    # the gather index, by scattering every source row to its place (or to a dump slot at `total`)
    idx = torch.full((total + 1,), B * (W + S) + M, dtype=torch.long, device=dev)  # the zero row
    slot = torch.arange(W, device=dev)
    win_row = torch.where(slot >= W - nv, key_off + slot - (W - nv), total)      # (B, W)
    idx.scatter_(0, win_row.flatten(), (lane * W + slot).flatten())
    idx.scatter_(0, tok_row.flatten(), (B * W + lane * S + t).flatten())
    if M:
        m = torch.arange(M, device=dev)
        idx.scatter_(0, torch.where(pre_used[:, None], pre_row.view(room, M), total).flatten(),
                     (B * (W + S) + m).expand(room, M).flatten())
    # the bounds: each document's first query and first key, in sequence order
    seq = torch.where(first, seq_off + seg, n_seq + 1)                            # (B, S), dump: n_seq + 1
    cu_q = torch.full((n_seq + 2,), B * S, dtype=torch.long, device=dev)
    cu_q.scatter_(0, seq.flatten(), (lane * S + t).flatten())
    k_first = torch.where(seg > 0, tok_row - M, key_off)                          # (B, S)
    after = (torch.arange(n_seq + 2, device=dev) - (B + extra.sum())).clamp_min(0)  # past the documents
    cu_k = (keys.sum() + after * max_k).clamp_max(total)
    cu_k.scatter_(0, seq.flatten(), k_first.flatten())
    return (idx[:total], tok_row.flatten(), win_row.flatten(), pre_row, pre_used,
            cu_q[:n_seq + 1].to(torch.int32), cu_k[:n_seq + 1].to(torch.int32))


class _GatherRows(torch.autograd.Function):
    """rows [window | chunk | prefix | a zero row] gathered by idx; the gradient taken back by
    gathers (every chunk row and valid window slot has one place, the prefix one per used copy):
    no scatter-add. The window has a gradient only where it holds kept tokens (their values carry
    their keep score's)."""

    @staticmethod
    def forward(ctx, chunk: Tensor, prefix: Tensor, window: Tensor, idx: Tensor, tok_row: Tensor,
                win_row: Tensor, pre_row: Tensor, pre_used: Tensor) -> Tensor:
        ctx.save_for_backward(tok_row, win_row, pre_row, pre_used)
        ctx.M = prefix.shape[0]
        zero = chunk.new_zeros(1, *chunk.shape[1:])
        return torch.cat([window, chunk, prefix, zero]).index_select(0, idx)

    @staticmethod
    def backward(ctx, grad: Tensor):
        tok_row, win_row, pre_row, pre_used = ctx.saved_tensors
        d_chunk = grad.index_select(0, tok_row)
        d_prefix = d_window = None
        if ctx.M and ctx.needs_input_grad[1]:
            copies = grad.index_select(0, pre_row).view(-1, ctx.M, *grad.shape[1:])
            copies = copies.to(torch.promote_types(grad.dtype, torch.float32))  # summed in fp32 at least
            d_prefix = (copies * pre_used.view(-1, 1, 1, 1)).sum(0).to(grad.dtype)
        if ctx.needs_input_grad[2]:   # an invalid slot's row is `total`: the zero row
            d_window = torch.cat([grad, grad.new_zeros(1, *grad.shape[1:])]).index_select(0, win_row)
        return d_chunk, d_prefix, d_window, None, None, None, None, None


def attend_segments_varlen(q: Tensor, k: Tensor, v: Tensor, seg: Tensor, room: int,
                           cache_k: Tensor | None = None, cache_v: Tensor | None = None,
                           cache_valid: Tensor | None = None, prefix_k: Tensor | None = None,
                           prefix_v: Tensor | None = None, kernel=None,
                           layouts: dict | None = None) -> Tensor:
    """`attend_segments` by the variable-length kernel (see SEGMENT_ROOM), for a window whose valid
    slots are a suffix of each lane's (KVCache's invariant, not checked) and at most `room`
    documents starting inside the chunk over all lanes (not checked). q, k, v (B, H, S, hd) ->
    (B, H, S, hd), a view of (B, S, H, hd) rows. `kernel`: as for `attend_varlen`. `layouts`: a
    dict the chunk's attention layers share, which keeps the first layer's `segment_layout` for
    the others (keyed by window, prefix and room sizes): the caller's promise that their windows
    hold the same valid slots (ElephantLM: every layer's window takes the same tokens)."""
    B, H, S, hd = q.shape
    W = 0 if cache_k is None else cache_k.shape[2]
    M = 0 if prefix_k is None else prefix_k.shape[2]
    key = (W, M, room)
    layout = None if layouts is None else layouts.get(key)
    if layout is None:
        n_valid = seg.new_zeros(B) if cache_k is None else cache_valid.sum(1)
        layout = segment_layout(seg, n_valid, W, M, room)
        if layouts is not None:
            layouts[key] = layout
    idx, tok_row, win_row, pre_row, pre_used, cu_q, cu_k = layout

    def rows(chunk: Tensor, cache: Tensor | None, prefix: Tensor | None) -> Tensor:
        window = (chunk.new_zeros(0, H, hd) if cache is None
                  else cache.to(chunk.dtype).transpose(1, 2).reshape(B * W, H, hd))
        pre = (chunk.new_zeros(0, H, hd) if prefix is None
               else prefix[0].to(chunk.dtype).transpose(0, 1))                   # (M, H, hd)
        return _GatherRows.apply(chunk.transpose(1, 2).reshape(B * S, H, hd), pre, window, idx,
                                 tok_row, win_row, pre_row, pre_used)

    Q = q.transpose(1, 2).reshape(B * S, H, hd)
    out = (kernel or flash_varlen)(Q, rows(k, cache_k, prefix_k), rows(v, cache_v, prefix_v), cu_q,
                                   cu_k, S, max(W, M) + S, 1.0 / math.sqrt(hd))
    return out.view(B, S, H, hd).transpose(1, 2)

# ------------------------------------------------------------------------------- free memory
def free_scores(q: Tensor, q_raw: Tensor, k: Tensor, k_raw: Tensor, free: Tensor
                ) -> tuple[Tensor, Tensor]:
    """Queries and keys (B, H, S, 2 hd) whose dot products are rot(q).rot(k) for the sequence's
    keys and q.k, without rotary, for the memory's (`free` (S,) bool): every query scores a
    memory key the same wherever it stands (mem_rotary "free"). Any attention kernel then takes
    them as they are: [rot q, q] against [rot k, 0] or [0, k]. The queries are scaled by sqrt(2)
    so that the kernel's 1 / sqrt(2 hd) is the layer's 1 / sqrt(hd). Keys from elsewhere (the
    window, kept tokens, the initial memory's prefix) take `pad_sequence_keys` / `pad_memory_keys`."""
    f = free.view(1, 1, -1, 1)
    qa = torch.cat([q, q_raw], dim=-1) * math.sqrt(2.0)
    ka = torch.cat([torch.where(f, 0.0, k), torch.where(f, k_raw, 0.0)], dim=-1).to(k.dtype)
    return qa, ka


def pad_sequence_keys(k: Tensor) -> Tensor:
    """Rotated keys (..., hd) of the sequence as `free_scores` keys: [k, 0]."""
    return torch.cat([k, torch.zeros_like(k)], dim=-1)


def pad_memory_keys(k: Tensor) -> Tensor:
    """Memory keys before rotary (..., hd) as `free_scores` keys: [0, k]."""
    return torch.cat([torch.zeros_like(k), k], dim=-1)


def kept_top(q: Tensor, keys: Tensor, valid: Tensor, read: int) -> Tensor:
    """Which kept tokens each head's each query reads when it may read `read` of them (model.
    kv_keep_read): the valid ones whose keys it scores highest (`read` exactly, ties broken
    either way), all the valid ones when there are no more. q (B, H, S, hd), keys (B, H, K, hd)
    as the kernel scores them (position-free memory's padded form too), valid (B, K) ->
    (B, H, S, K) bool. A choice, so no gradient. The masked path's; the two-part read
    (`kept_read.top_kept_read`) makes the same choice from the same scores."""
    with torch.no_grad():
        seen = valid[:, None, None, :]
        s = torch.matmul(q, keys.to(q.dtype).transpose(-1, -2)).masked_fill(~seen, float("-inf"))
        top = s.topk(read, dim=-1, sorted=False).indices       # unsorted: a select, no sort
        best = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, top, True)
        return best & seen


def records_graph(*tensors: Tensor) -> bool:
    """Whether autograd records a graph of an operation on `tensors` (grad mode on and one of
    them requiring a gradient): the two-part kept read runs only where it does not."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def with_kept_first(kept_k: Tensor, kept_v: Tensor, kept_valid: Tensor, cache_k: Tensor,
                    cache_v: Tensor, cache_valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The kept tokens (B, H, K, hd), (B, K) and the window (B, H, W, hd), (B, W) as one cache of
    K + W slots whose valid ones are the last of each lane's, in their order: kept tokens first,
    then the window. The window's valid slots are a suffix of it (KVCache), the kept tokens' are
    not; moving the invalid slots to the front (a stable sort, one gather) lets the
    variable-length kernel read the cache, as it reads a window. Which slot holds a key does not
    change what a query computes: each key carries its position in its rotation, and the cache's
    valid keys are all visible to every query of the lane's first document."""
    valid = torch.cat([kept_valid, cache_valid], dim=1)                       # (B, K + W)
    order = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices      # invalid first
    idx = order[:, None, :, None]
    k, v = torch.cat([kept_k, cache_k], dim=2), torch.cat([kept_v, cache_v], dim=2)
    return (k.gather(2, idx.expand_as(k)), v.gather(2, idx.expand_as(v)), valid.gather(1, order))


# ------------------------------------------------------------------------------- the layer
class Attention(nn.Module):
    """Multi-head causal self-attention with per-lane rotary positions and a carried K/V window.

    Parameters: `qkv` (D -> 3D), `o` (D -> D), no biases; with cfg.qk_norm, `q_norm` / `k_norm`
    (RMS norm over the head dimension, one gain per head channel shared by the heads). Weights keep
    nn.Linear's default init; the model's `reset_parameters` sets them (`o` by name as a residual
    output). `backend` (sdpa | flex | reference) picks the kernel when a cache is given.
    """

    def __init__(self, cfg, backend: str | None = None):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.rope_base, self.rope_max_period = float(cfg.rope_base), float(cfg.rope_max_period)
        self.keep_read = cfg.kv_keep_read   # kept tokens a query reads at most (0: all, `kept_top`)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.o = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.window = cfg.kv_window
        if cfg.kv_keep:  # the learned keep score of a token: <keep_w, its normalized input> + keep_b
            self.keep_w = nn.Parameter(torch.empty(cfg.d_model).normal_(std=cfg.init_std))
            self.keep_b = nn.Parameter(torch.zeros(1))
        if cfg.kv_assoc:  # the associative memory's read gate per head (assoc.py)
            self.assoc_w = nn.Parameter(torch.zeros(cfg.d_model, cfg.n_heads))
            self.assoc_b = nn.Parameter(torch.full((cfg.n_heads,), assoc.GATE_BIAS))
        # on CUDA, the queries, keys and values made by one kernel each way (layers/rotary_triton.py;
        # False: the plain path, which the tests hold it to)
        self.fused_qkv = True
        self.backend = backend or DEFAULT_BACKEND
        if self.backend not in BACKENDS:
            raise ValueError(f"attention backend: expected one of {', '.join(BACKENDS)} "
                             f"(ELEPHANT_ATTN), got {self.backend!r}")

    def keep_score(self, x: Tensor) -> Tensor:
        """The keep score (..., ) of tokens whose normalized layer input is x (..., D): which
        tokens the layer's long-term memory keeps (higher first), and, through sigmoid(score),
        how much of a kept token's value a query reads (the score's gradient comes from there)."""
        return (x.to(self.keep_w.dtype) * self.keep_w).sum(-1) + self.keep_b

    def reads_some_kept(self, K: int) -> bool:
        """Whether each query reads only some of K kept tokens (model.kv_keep_read < K): its
        best, chosen as `kept_top` chooses, in the chunked forward and the generation step alike
        (at inference both read them apart from the window: `attend_top_kept`)."""
        return 0 < self.keep_read < K

    def kept_tokens(self, cache, start: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Keys, values and validity ((B, H, K, hd), (B, K)) of the kept tokens of `cache` for a
        chunk starting at position `start` (B,) of the lane's document. A kept token reads as if
        it stood just before the window (position start - W - 1), whatever its real distance, so
        a query meets it at a distance it met in training; its value is scaled by sigmoid(keep
        score), with gradient; it is hidden while it is still in the window (position >=
        start - W)."""
        edge = start - self.window
        k = rotate_at(cache.keep_k, edge - 1, self.rope_base, self.rope_max_period)
        gate = torch.sigmoid(self.keep_score(cache.keep_x))                  # (B, K)
        v = cache.keep_v * gate[:, None, :, None].to(cache.keep_v.dtype)
        return k, v, cache.keep_valid & (cache.keep_pos < edge[:, None])

    def assoc_read(self, x: Tensor, q_raw: Tensor, S: Tensor, seg: Tensor | None,
                   offset: Tensor) -> Tensor:
        """What the queries before rotary q_raw (B, H, S, hd) of inputs x (B, S, D) add to the
        attention's output from the associative memory S (B, H, hd, hd) (model.kv_assoc,
        layers/assoc.py): the read times its gate sigmoid(<assoc_w, x> + assoc_b) per head,
        (B, H, S, hd) in float32; with seg (B, S), only the carried document's tokens (0) read.
        The keys were written before rotary (position 0); a query at `offset` (S,) or (B, S) into
        its chunk is turned to position W + 1 + offset, so that it scores them as it scores a key
        just past the window (the kept tokens' place, `kept_tokens`)."""
        work = torch.promote_types(q_raw.dtype, torch.float32)
        cos, sin = rotary_cos_sin((self.window + 1 + offset).expand(q_raw.shape[0], q_raw.shape[2]),
                                  self.head_dim, self.rope_base, work, self.rope_max_period)
        q = apply_rotary(q_raw.to(work), cos, sin)
        gate = torch.sigmoid(x.to(self.assoc_w.dtype) @ self.assoc_w + self.assoc_b)   # (B, S, H)
        read = assoc.assoc_read(S, q) * gate.transpose(1, 2)[..., None].to(S.dtype)
        return read if seg is None else read * (seg == 0)[:, None, :, None]

    def use_fused(self, y: Tensor) -> bool:
        """Whether `project` makes q, k and v of the projection output y by the kernel
        (rotary_triton: on CUDA, unless `fused_qkv` is off)."""
        return self.fused_qkv and y.is_cuda and rotary_triton.supported(y, self.n_heads, self.head_dim)

    def _normed(self, t: Tensor, norm: nn.RMSNorm | None, work: torch.dtype) -> Tensor:
        """Query or key heads t (..., hd) in the `work` dtype, RMS-normalized with `norm` (qk_norm)."""
        t = t.to(work)
        return t if norm is None else F.rms_norm(t, (self.head_dim,), norm.weight.to(work), norm.eps)

    def project(self, x: Tensor, pos: Tensor, raw: bool = False, raw_q: bool = False,
                read_q: bool = False):
        """Queries, rotated keys and values (B, H, S, hd) of x (B, S, D) at positions pos (B, S):
        shared by the chunk forward and the generation step. `raw`: also the keys before rotary;
        `raw_q`: then also the queries before rotary (position-free memory, `free_scores`);
        `read_q` (with `raw`, not `raw_q`): then also the queries before rotary, with gradient
        (the associative memory's read), on the fused path too."""
        B, S, D = x.shape
        H, hd = self.n_heads, self.head_dim
        y = self.qkv(x)                                                          # (B, S, 3D)
        dtype = y.dtype
        work = torch.promote_types(dtype, torch.float32)  # norm and rotary in float32 (or 64)
        if not raw_q and self.use_fused(y):
            cos, sin = rotary_cos_sin(pos, hd, self.rope_base, torch.float32, self.rope_max_period)
            norm = self.q_norm is not None
            out = rotary_triton.qkv_prepare(
                y, cos.squeeze(1), sin.squeeze(1), self.q_norm.weight if norm else None,
                self.k_norm.weight if norm else None, self.q_norm.eps if norm else 0.0, H)
            if not raw:
                return out
            with torch.no_grad():  # the keys before rotary, for kept tokens (carried without gradient)
                k_raw = self._normed(y.detach().view(B, S, 3, H, hd)[:, :, 1].transpose(1, 2),
                                     self.k_norm, work)
            if read_q:
                q_raw = self._normed(y.view(B, S, 3, H, hd)[:, :, 0].transpose(1, 2), self.q_norm, work)
                return (*out, k_raw.to(dtype), q_raw.to(dtype))
            return (*out, k_raw.to(dtype))
        q, k, v = y.view(B, S, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)     # (B, H, S, hd)
        q, k = self._normed(q, self.q_norm, work), self._normed(k, self.k_norm, work)
        cos, sin = rotary_cos_sin(pos, hd, self.rope_base, work, self.rope_max_period)
        out = apply_rotary(q, cos, sin).to(dtype), apply_rotary(k, cos, sin).to(dtype), v
        if raw_q or (raw and read_q):
            return (*out, k.to(dtype), q.to(dtype))
        return (*out, k.to(dtype)) if raw else out

    def forward(self, x: Tensor, pos: Tensor, cache_k: Tensor | None = None,
                cache_v: Tensor | None = None, cache_valid: Tensor | None = None,
                seg: Tensor | None = None, prefix_k: Tensor | None = None,
                prefix_v: Tensor | None = None, kept=None, start: Tensor | None = None,
                free: Tensor | None = None, room: int = 0, layouts: dict | None = None):
        """x (B, S, D), pos (B, S) int64; cache_k/v (B, H, W, hd) rotated, cache_valid (B, W) bool.
        seg (B, S) segment ids of packed documents, prefix_k/v, room (how many documents may
        start inside the chunk for the variable-length kernel, 0: none) and layouts (shared by
        the chunk's layers): see `attend_segments`.
        kept: the KVCache whose kept tokens the chunk also reads (model.kv_keep; `start` (B,) the
        chunk's first position), before the window and like it (`kept_tokens`); where each query
        reads only some of them, by the two-part read when no gradient is recorded and seg is
        None (`attend_top_kept`), else by a mask per head and query.
        free (S,) bool: the memory tokens, whose keys every query scores without rotary
        (mem_rotary "free", `free_scores`; the prefix keys count as memory too).

        Returns y (B, S, D) and this chunk's rotated k and its v, (B, H, S, hd) each; with `kept`
        also the keys before rotary (what kept tokens store).
        """
        B, S, D = x.shape
        S_assoc = None if kept is None or cache_k is None else kept.assoc
        q, k, v, *raw = self.project(x, pos, raw=kept is not None or free is not None,
                                     raw_q=free is not None,
                                     read_q=S_assoc is not None)  # (B, H, S, hd) each
        k_raw = raw[:1] if kept is not None else []
        if cache_k is not None and cache_valid is None:
            raise ValueError("Attention: cache_k given without cache_valid (B, W) bool")
        top = 0   # with more kept tokens than a query reads: how many there are (`kept_top`)
        two_part = False   # ... read apart from the window (`attend_top_kept`)
        if cache_k is not None:   # the window carries no gradient (Transformer-XL)
            cache_k, cache_v = cache_k.detach(), cache_v.detach()
            if kept is not None:
                kept_k, kept_v, kept_valid = self.kept_tokens(kept, start)
                if not self.reads_some_kept(kept_k.shape[2]):
                    # kept tokens and window as one cache, its valid slots last
                    cache_k, cache_v, cache_valid = with_kept_first(kept_k, kept_v, kept_valid,
                                                                    cache_k, cache_v, cache_valid)
                elif KEPT_TWO_PART and seg is None and not records_graph(q, kept_v):
                    two_part = True   # inference, documents not packed: no mask
                else:   # training, or packed documents: a mask per head and query over [kept | window]
                    top = kept_k.shape[2]
                    cache_k = torch.cat([kept_k.to(cache_k.dtype), cache_k], dim=2)
                    cache_v = torch.cat([kept_v.to(cache_v.dtype), cache_v], dim=2)
        qa, ka = q, k
        if free is not None:    # the scores on doubled head dims; the window keeps the rotated k
            qa, ka = free_scores(q, raw[1], k, raw[0], free)
            cache_k = None if cache_k is None else pad_sequence_keys(cache_k)
            prefix_k = None if prefix_k is None else pad_memory_keys(prefix_k)
        if top:   # what each head's each query sees of [kept | window]: (B, H, S, K + W)
            seen = kept_top(qa, cache_k[:, :, :top], kept_valid, self.keep_read)
            W = cache_valid.shape[1]
            cache_valid = torch.cat([seen, cache_valid[:, None, None, :].expand(
                B, self.n_heads, qa.shape[2], W)], dim=-1)
        if two_part:      # [window | chunk] and each query's best kept tokens, merged
            y = attend_top_kept(qa, ka, v, cache_k, cache_v, cache_valid, q, kept_k, kept_v,
                                kept_valid, self.keep_read, self.backend)
        elif seg is None:   # the cache's valid slots are a suffix of each lane's (KVCache, with_kept_first)
            y = attend(qa, ka, v, cache_k, cache_v, cache_valid, self.backend,
                       valid_suffix=True)                                      # (B, H, S, hd)
        else:             # a layer's own kept tokens: its valid slots are not its neighbours'
            y = attend_segments(qa, ka, v, seg, cache_k, cache_v, cache_valid, prefix_k, prefix_v,
                                room=room, layouts=layouts if kept is None else None)
        if S_assoc is not None:   # the associative memory, read by the queries before rotary
            y = (y + self.assoc_read(x, raw[1], S_assoc, seg,
                                     torch.arange(S, device=x.device))).to(y.dtype)
        y = y.transpose(1, 2).reshape(B, S, D)
        return (self.o(y), k, v, *k_raw)
