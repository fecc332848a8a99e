"""Attention over [cached K/V | chunk] with per-lane rotary positions (CPU, float64)."""
import math

import pytest
import torch
import torch.nn.functional as F

from elephant.config import ModelConfig
from elephant.layers.attention import (SEGMENT_ROOM, Attention, apply_rotary, attend,
                                       attend_flex, attend_reference, attend_segments,
                                       attend_segments_varlen, attend_varlen, attention_mask,
                                       masked_sdpa, rotary_cos_sin, segment_layout, segment_room,
                                       varlen_bounds, varlen_supported)

B, D, H = 3, 32, 4
HD = D // H


def make_attention(qk_norm: bool = True, backend: str = "sdpa", seed: int = 0) -> Attention:
    torch.manual_seed(seed)
    attn = Attention(ModelConfig(d_model=D, n_heads=H, qk_norm=qk_norm, rope_base=100.0),
                     backend=backend).double()
    if qk_norm:  # non-trivial gains
        for norm in (attn.q_norm, attn.k_norm):
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    return attn


def garbage(*shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 5


def run_in_chunks(attn, x, pos, sizes, W, seed=0):
    """Feed x (B, L, D) chunk by chunk; each chunk's cache is the last W of the previous k/v,
    right-aligned, with the unfilled slots invalid and full of garbage."""
    cache_k, cache_v = garbage(B, H, W, HD, seed=seed), garbage(B, H, W, HD, seed=seed + 1)
    valid = torch.zeros(B, W, dtype=torch.bool)
    ys, ks, vs, start = [], [], [], 0
    for size in sizes:
        sl = slice(start, start + size)
        y, k, v = attn(x[:, sl], pos[:, sl], cache_k, cache_v, valid)
        ys.append(y), ks.append(k), vs.append(v)
        cache_k = torch.cat([cache_k, k.detach()], dim=2)[:, :, -W:]
        cache_v = torch.cat([cache_v, v.detach()], dim=2)[:, :, -W:]
        valid = torch.cat([valid, torch.ones(B, size, dtype=torch.bool)], dim=1)[:, -W:]
        start += size
    return torch.cat(ys, 1), torch.cat(ks, 2), torch.cat(vs, 2)


def naive_attention(q, k, v, mask):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


# ------------------------------------------------------------------------------- the contract
@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_chunked_equals_whole_sequence(backend, qk_norm):
    attn = make_attention(qk_norm, backend)
    L = 24
    x = garbage(B, L, D, seed=7)
    pos = torch.arange(L).expand(B, L) + torch.tensor([[0], [5], [1000]])  # lanes mid-document
    y_whole, k_whole, v_whole = attn(x, pos)
    for sizes, W in [([5, 8, 11], L), ([1, 23], 30), ([24], 8), ([7, 7, 7, 3], 24)]:
        y, k, v = run_in_chunks(attn, x, pos, sizes, W)
        torch.testing.assert_close(y, y_whole, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(k, k_whole, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(v, v_whole, rtol=1e-12, atol=1e-12)


def test_window_sees_only_the_last_w_keys():
    """With W smaller than the history, a query sees the last W cached keys and its chunk."""
    attn = make_attention()
    L, W, S = 20, 6, 5
    x = garbage(1, L, D, seed=8)
    pos = torch.arange(L).expand(1, L)
    _, k, v = attn(x[:, :L - S], pos[:, :L - S])
    y, _, _ = attn(x[:, -S:], pos[:, -S:], k[:, :, -W:], v[:, :, -W:], torch.ones(1, W, dtype=torch.bool))
    y_ref, _, _ = attn(x[:, L - S - W:], pos[:, L - S - W:])         # the same window, uncached
    torch.testing.assert_close(y, y_ref[:, -S:], rtol=1e-12, atol=1e-12)


def test_invalid_cache_slots_have_no_effect():
    attn = make_attention()
    S, W = 6, 10
    x, pos = garbage(B, S, D, seed=1), torch.arange(S).expand(B, S) + 10
    valid = torch.rand(B, W, generator=torch.Generator().manual_seed(0)) < 0.5
    cache_k, cache_v = garbage(B, H, W, HD, seed=2), garbage(B, H, W, HD, seed=3)
    y = attn(x, pos, cache_k, cache_v, valid)[0]
    inv = ~valid[:, None, :, None]
    other_k = torch.where(inv, garbage(B, H, W, HD, seed=4) * 100, cache_k)
    other_v = torch.where(inv, garbage(B, H, W, HD, seed=5) * 100, cache_v)
    assert torch.equal(attn(x, pos, other_k, other_v, valid)[0], y)
    # an all-invalid cache is no cache: a lane after its reset
    none_valid = torch.zeros(B, W, dtype=torch.bool)
    torch.testing.assert_close(attn(x, pos, cache_k, cache_v, none_valid)[0], attn(x, pos)[0],
                               rtol=1e-12, atol=1e-12)


def test_lanes_are_independent():
    attn = make_attention()
    S, W = 5, 7
    x, pos = garbage(B, S, D, seed=1), torch.arange(S).expand(B, S) + 3
    cache_k, cache_v = garbage(B, H, W, HD, seed=2), garbage(B, H, W, HD, seed=3)
    valid = torch.ones(B, W, dtype=torch.bool)
    y = attn(x, pos, cache_k, cache_v, valid)[0]
    x2, pos2, k2, v2, valid2 = x.clone(), pos.clone(), cache_k.clone(), cache_v.clone(), valid.clone()
    x2[1] += 1
    pos2[1] += 50
    k2[1] *= -1
    v2[1] += 3
    valid2[1, :4] = False
    y2 = attn(x2, pos2, k2, v2, valid2)[0]
    torch.testing.assert_close(y2[[0, 2]], y[[0, 2]], rtol=1e-13, atol=1e-13)
    assert not torch.allclose(y2[1], y[1])
    for lane in range(B):                                            # one lane alone = in the batch
        one = attn(x[lane:lane + 1], pos[lane:lane + 1], cache_k[lane:lane + 1],
                   cache_v[lane:lane + 1], valid[lane:lane + 1])[0]
        torch.testing.assert_close(one, y[lane:lane + 1], rtol=1e-13, atol=1e-13)


def test_negative_position_means_no_rotation():
    cos, sin = rotary_cos_sin(torch.tensor([[-1, -7, 0, 3]]), HD, 100.0, torch.float64)
    assert torch.equal(cos[0, 0, :3], torch.ones(3, HD // 2))
    assert torch.equal(sin[0, 0, :3], torch.zeros(3, HD // 2))
    attn = make_attention()
    x = garbage(1, 4, D, seed=9)
    _, k_neg, _ = attn(x, torch.full((1, 4), -1))
    _, k_zero, _ = attn(x, torch.zeros(1, 4, dtype=torch.long))
    _, k_pos, _ = attn(x, torch.full((1, 4), 9))
    assert torch.equal(k_neg, k_zero)
    assert not torch.allclose(k_neg, k_pos)
    # unrotated = the normalized projection
    k_raw = attn.qkv(x).view(1, 4, 3, H, HD)[:, :, 1].transpose(1, 2)
    k_raw = F.rms_norm(k_raw, (HD,), attn.k_norm.weight, attn.k_norm.eps)
    torch.testing.assert_close(k_neg, k_raw, rtol=1e-14, atol=1e-14)


def test_rotary_keeps_norms_and_rotates_by_position():
    x = garbage(2, H, 5, HD, seed=10)
    pos = torch.arange(5).expand(2, 5) * 37
    cos, sin = rotary_cos_sin(pos, HD, 10000.0, torch.float64)
    xr = apply_rotary(x, cos, sin)
    torch.testing.assert_close(xr.norm(dim=-1), x.norm(dim=-1), rtol=1e-13, atol=1e-13)
    # frequency 0 turns by exactly pos radians on the pair (0, hd/2)
    angle = torch.atan2(xr[..., HD // 2], xr[..., 0]) - torch.atan2(x[..., HD // 2], x[..., 0])
    torch.testing.assert_close(torch.remainder(angle - pos[:, None].double(), 2 * math.pi).sin(),
                               torch.zeros(2, H, 5, dtype=torch.float64), atol=1e-10, rtol=0)


def test_shifting_all_positions_leaves_output_unchanged():
    attn = make_attention()
    L = 16
    x = garbage(B, L, D, seed=11)
    pos = torch.arange(L).expand(B, L)
    y0, _, _ = attn(x, pos)
    for shift in (1, 977, 123_456):
        y1, _, _ = attn(x, pos + shift)
        torch.testing.assert_close(y1, y0, rtol=1e-9, atol=1e-9)
        y2, _, _ = run_in_chunks(attn, x, pos + shift, [6, 10], W=12)
        torch.testing.assert_close(y2[:, 6:], y0[:, 6:], rtol=1e-9, atol=1e-9)


def test_gradients_reach_x_and_weights_not_the_cache():
    attn = make_attention()
    S, W = 5, 4
    x = garbage(B, S, D, seed=12).requires_grad_()
    pos = torch.arange(S).expand(B, S) + W
    cache_k = garbage(B, H, W, HD, seed=13).requires_grad_()       # even if the caller forgot to detach
    cache_v = garbage(B, H, W, HD, seed=14)
    y, k, v = attn(x, pos, cache_k, cache_v, torch.ones(B, W, dtype=torch.bool))
    (y.square().sum() + k.sum() + v.sum()).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is not None for p in attn.parameters())
    assert cache_k.grad is None
    # a detached cache (what the model passes) needs no gradient at all
    y, _, _ = attn(x, pos, cache_k.detach(), cache_v, torch.ones(B, W, dtype=torch.bool))
    assert y.requires_grad


def test_no_cache_gradients_equal_reference_path():
    x = garbage(B, 9, D, seed=15).requires_grad_()
    pos = torch.arange(9).expand(B, 9)
    grads = []
    for backend in ("sdpa", "reference"):
        attn = make_attention(backend=backend)
        x.grad = None
        y, _, _ = attn(x, pos)
        y.pow(3).sum().backward()
        grads.append([y.detach(), x.grad.clone()] + [p.grad for p in attn.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------- the kernels
def test_mask_is_valid_cache_then_causal():
    valid = torch.tensor([[False, True, True], [True, False, True]])
    mask = attention_mask(4, valid)
    assert mask.shape == (2, 1, 4, 7)
    assert torch.equal(mask[:, 0, :, :3], valid[:, None, :].expand(2, 4, 3))
    assert torch.equal(mask[0, 0, :, 3:], torch.ones(4, 4, dtype=torch.bool).tril())
    assert mask.any(-1).all()                                        # no empty row
    assert attention_mask(4, None).shape == (1, 1, 4, 4)


def test_paths_match_naive_softmax():
    S, W = 6, 5
    q, k, v = (garbage(B, H, S, HD, seed=s) for s in (20, 21, 22))
    ck, cv = garbage(B, H, W, HD, seed=23), garbage(B, H, W, HD, seed=24)
    valid = torch.rand(B, W, generator=torch.Generator().manual_seed(1)) < 0.6
    mask = attention_mask(S, valid)
    want = naive_attention(q, torch.cat([ck, k], 2), torch.cat([cv, v], 2), mask)
    for got in (attend_reference(q, k, v, ck, cv, valid), attend(q, k, v, ck, cv, valid)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    want = naive_attention(q, k, v, attention_mask(S, None))
    torch.testing.assert_close(attend(q, k, v), want, rtol=1e-12, atol=1e-12)


def test_padding_keeps_the_value_head_dim_of_position_free_memory():
    """With position-free memory (free_scores) queries and keys have twice the values' head dim;
    padding the keys to an alignment pads the values in their own dim (it padded them like the
    keys: "Sizes of tensors must match" on every unaligned CUDA call)."""
    S, n = 5, 21
    q, k = (garbage(B, H, S if s == 40 else n, 2 * HD, seed=s) for s in (40, 41))
    v = garbage(B, H, n, HD, seed=42)
    mask = torch.rand(B, 1, S, n, generator=torch.Generator().manual_seed(3)) < 0.5
    mask[..., 0] = True
    got = masked_sdpa(q, k, v, mask, align=16)
    assert got.shape == (B, H, S, HD)
    torch.testing.assert_close(got, masked_sdpa(q, k, v, mask, align=0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [7, 16, 21])
def test_keys_padded_to_an_alignment_change_nothing(n):
    """masked_sdpa's padding (zero keys no query sees, what CUDA gets) gives the unpadded result,
    values and gradients, also with a mask broadcast over lanes."""
    S = 5
    q, k, v = (garbage(B, H, S if s == 30 else n, HD, seed=s).requires_grad_() for s in (30, 31, 32))
    mask = torch.rand(B, 1, S, n, generator=torch.Generator().manual_seed(2)) < 0.5
    mask[..., 0] = True                                              # no empty row
    for m in (mask, mask[:1]):
        want = masked_sdpa(q, k, v, m, align=0)
        grads = torch.autograd.grad(want.square().sum(), (q, k, v))
        got = masked_sdpa(q, k, v, m, align=16)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got, naive_attention(q, k, v, m), rtol=1e-12, atol=1e-12)
        for g, w in zip(torch.autograd.grad(got.square().sum(), (q, k, v)), grads):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """What FlashAttention's varlen kernel computes, sequence by sequence: q (total_q, H, hd)
    against k, v (total_k, H, hd), causal aligned to each sequence's last key; a sequence
    without queries computes nothing."""
    out = torch.zeros_like(q)
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = (int(t) for t in (cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]))
        nq, nk = q1 - q0, k1 - k0
        assert nq <= max_q and nk <= max_k
        if nq == 0:
            continue
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1], k[k0:k1]) * scale
        seen = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        p = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out = out.index_copy(0, torch.arange(q0, q1), torch.einsum("hqk,khd->qhd", p, v[k0:k1]))
    return out


def test_varlen_bounds_split_each_lane_at_its_first_valid_slot():
    cu_q, cu_k = varlen_bounds(torch.tensor([4, 0, 2]), S=3, W=4)
    assert cu_q.dtype == cu_k.dtype == torch.int32
    # lane 0: all 4 slots valid (an empty first sequence); lane 1: none; lane 2: the last 2
    assert cu_q.tolist() == [0, 0, 3, 3, 6, 6, 9]
    assert cu_k.tolist() == [0, 0, 7, 11, 14, 16, 21]


def test_varlen_layout_equals_the_masked_reference():
    """attend_varlen's sequences (its bounds and its flattened [cache | chunk] rows) with the
    kernel replaced by what FlashAttention computes: the masked reference's values and gradients,
    for windows full, empty and partly valid (a suffix of the window, as KVCache keeps it)."""
    S, W = 5, 6
    q, k, v = (garbage(4, H, S, HD, seed=s).requires_grad_() for s in (50, 51, 52))
    ck, cv = garbage(4, H, W, HD, seed=53), garbage(4, H, W, HD, seed=54)
    n_valid = torch.tensor([W, 0, 1, 4])
    valid = torch.arange(W)[None, :] >= (W - n_valid)[:, None]
    got = attend_varlen(q, k, v, ck, cv, valid, kernel=varlen_reference)
    want = attend_reference(q, k, v, ck, cv, valid)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dy = garbage(*want.shape, seed=55)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), dy), torch.autograd.grad(want, (q, k, v), dy)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    # the invalid slots' garbage reaches nothing
    ck2 = torch.where(valid[:, None, :, None], ck, garbage(4, H, W, HD, seed=56))
    torch.testing.assert_close(attend_varlen(q, k, v, ck2, cv, valid, kernel=varlen_reference), got,
                               rtol=0, atol=0)


# packed chunks: lane 0 one document; lane 1 three; lane 2 four, one of a single token; lane 3 two
SEGS = torch.tensor([[0] * 9, [0, 0, 1, 1, 1, 2, 2, 2, 2], [0, 1, 2, 3, 3, 3, 3, 3, 3],
                     [0, 0, 0, 0, 0, 0, 1, 1, 1]])


def test_segment_layout_bounds():
    """The sequences of a packed chunk: each lane's documents in order, lane after lane; then empty
    ones and query-less ones over the unused rows, none longer than max(W, M) + S keys."""
    W, M, S = 5, 3, 9
    n_valid = torch.tensor([5, 0, 2, 3])
    room = 8                                                        # 6 inner starts: 2 to spare
    idx, tok_row, win_row, _, _, cu_q, cu_k = segment_layout(SEGS, n_valid, W, M, room)
    total = 4 * (W + S) + room * M
    # each chunk key and valid window slot is gathered from its own source row; invalid slots
    # point past the layout (the zero row of the window's gradient)
    assert idx[tok_row].tolist() == list(range(4 * W, 4 * (W + S)))
    valid = (torch.arange(W)[None, :] >= (W - n_valid)[:, None]).flatten()
    assert idx[win_row[valid]].tolist() == torch.arange(4 * W)[valid].tolist()
    assert (win_row[~valid] == total).all()
    assert idx.shape == (total,) and cu_q.dtype == cu_k.dtype == torch.int32
    n_q, n_k = cu_q.diff().tolist(), cu_k.diff().tolist()
    # lane 0: 5 valid slots + 9 tokens; lane 1: 2 tokens, then [3 prefix keys | 3], [3 | 4]; ...
    assert n_q[:10] == [9, 2, 3, 4, 1, 1, 1, 6, 6, 3]
    assert n_k[:10] == [14, 2, 6, 7, 3, 4, 4, 9, 9, 6]
    assert n_q[10:] == [0] * (len(n_q) - 10) and cu_k[-1] == total
    assert max(n_k) <= max(W, M) + S and min(n_k) >= 0
    # the gathered rows of lane 1's second document: the prefix (rows after window and chunk), then
    # its own tokens (chunk rows of lane 1, tokens 2-4)
    first = int(cu_k[2])
    prefix_rows = [4 * W + 4 * S + m for m in range(M)]
    assert idx[first:first + 6].tolist() == prefix_rows + [4 * W + S + t for t in (2, 3, 4)]


@pytest.mark.parametrize("cache, prefix", [(True, True), (True, False), (False, True),
                                           (False, False)])
def test_segment_varlen_layout_equals_the_masked_reference(cache, prefix):
    """attend_segments_varlen (its gathered keys and bounds) with the kernel replaced by what
    FlashAttention computes: attend_segments' masked values and gradients (prefix included), with
    the layout full (room = the inner starts) and with room to spare; the invalid window slots'
    contents reach nothing."""
    S, W, M = SEGS.shape[1], 5, 3
    n_valid = torch.tensor([5, 0, 2, 3])
    valid = torch.arange(W)[None, :] >= (W - n_valid)[:, None]
    q, k, v = (garbage(4, H, S, HD, seed=s).requires_grad_() for s in (60, 61, 62))
    ck, cv = garbage(4, H, W, HD, seed=63), garbage(4, H, W, HD, seed=64)
    pk, pv = (garbage(1, H, M, HD, seed=s).requires_grad_() for s in (65, 66))
    win = (ck, cv, valid) if cache else (None, None, None)
    pre = (pk, pv) if prefix else (None, None)
    inputs = (q, k, v, pk, pv) if prefix else (q, k, v)
    want = attend_segments(q, k, v, SEGS, *win, *pre)
    dy = garbage(*want.shape, seed=67)
    grads = torch.autograd.grad(want, inputs, dy)
    inner = int(SEGS[:, -1].sum())
    for room in (inner, inner + 5):
        got = attend_segments_varlen(q, k, v, SEGS, room, *win, *pre, kernel=varlen_reference)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for g, w in zip(torch.autograd.grad(got, inputs, dy), grads):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    if cache:
        ck2 = torch.where(valid[:, None, :, None], ck, garbage(4, H, W, HD, seed=68))
        again = attend_segments_varlen(q, k, v, SEGS, inner, ck2, cv, valid, *pre,
                                       kernel=varlen_reference)
        torch.testing.assert_close(again, got, rtol=0, atol=0)


def test_segment_room_fits_the_inner_starts_or_is_zero():
    assert segment_room(4, 0) == segment_room(4, 4 * SEGMENT_ROOM) == 4 * SEGMENT_ROOM
    assert segment_room(4, 4 * SEGMENT_ROOM + 1) == 0 and segment_room(4, None) == 0


def test_varlen_path_is_cuda_16_bit_only():
    q = torch.zeros(1, 1, 2, 8)
    assert not varlen_supported(q, q) and not varlen_supported(q.half(), q.half())


@pytest.mark.filterwarnings("ignore")
def test_flex_block_mask_matches_reference_forward():
    """FlexAttention's mask logic, forward only (its CPU backward does not exist)."""
    S, W = 7, 5
    q, k, v = (garbage(B, H, S, HD, seed=s).float() for s in (30, 31, 32))
    ck, cv = garbage(B, H, W, HD, seed=33).float(), garbage(B, H, W, HD, seed=34).float()
    valid = torch.rand(B, W, generator=torch.Generator().manual_seed(2)) < 0.5
    with torch.no_grad():
        got = attend_flex(q, k, v, ck, cv, valid, compiled=False)
    torch.testing.assert_close(got, attend_reference(q, k, v, ck, cv, valid), rtol=1e-5, atol=1e-5)


def test_cache_in_another_dtype_is_cast():
    attn = make_attention()
    S, W = 4, 3
    x, pos = garbage(1, S, D, seed=40), torch.arange(S).expand(1, S) + W
    ck, cv = garbage(1, H, W, HD, seed=41), garbage(1, H, W, HD, seed=42)
    valid = torch.ones(1, W, dtype=torch.bool)
    y64 = attn(x, pos, ck, cv, valid)[0]
    y32 = attn(x, pos, ck.float(), cv.float(), valid)[0]
    assert y32.dtype == torch.float64
    torch.testing.assert_close(y32, y64, rtol=1e-5, atol=1e-5)


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="ELEPHANT_ATTN"):
        Attention(ModelConfig(d_model=D, n_heads=H), backend="flash3")


def test_rotary_pairs_of_a_long_period_are_not_rotated():
    # partial rotary (model.rope_max_period): pairs whose period is over the limit keep cos 1,
    # sin 0 at any position; the others are the full rotary's
    from elephant.layers.attention import inverse_frequencies
    pos = torch.tensor([[0, 3, 5000, 10 ** 6]])
    full = rotary_cos_sin(pos, 16, 10000.0, torch.float64)
    part = rotary_cos_sin(pos, 16, 10000.0, torch.float64, max_period=100.0)
    period = 2 * torch.pi / inverse_frequencies(16, 10000.0)
    long = period > 100.0
    assert 0 < long.sum() < 8
    for a, b, still in zip(full, part, (1.0, 0.0)):
        assert torch.equal(b[..., ~long], a[..., ~long])
        assert (b[..., long] == still).all()
