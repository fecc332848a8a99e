"""The Mamba block's causal depthwise conv as Triton kernels, channels last, with document segments.

    depthwise_conv(x, conv_state, weight, bias, seg=None, tail=None) -> (out (B, L, C), new state)

x (B, L, C) is the conv's input as the in-projection leaves it (any strides: a slice of the
projection's output, no transpose or copy), conv_state (B, C, K-1) the inputs carried from the
previous chunk, weight (C, 1, K), bias (C,). Output t reads inputs t-K+1 .. t of [conv_state | x],
accumulated in float32 and rounded to x's dtype. With `seg` (B, L) nondecreasing segment ids
(0 = the lane's carried document), a tap that would read another segment's input reads zero, or for
a segment > 0 the matching input of `tail` (C, K-1), the inputs that segment starts after: exactly
`mamba.segment_conv` (the reference the tests hold it to), without forming the shifted windows.

Why: the plain path paid a transpose and a concatenation of the whole input to put the carried
state in front (one full copy), then a cuDNN depthwise conv at a fraction of the memory bandwidth;
the segment path paid a chain of masked sums whose weight gradient compiled into a slow reduction.
Here the forward reads each input K times from cache and writes the output once; the backward
writes dx once and the weight, bias and tail gradients as per-block partial sums (deterministic:
summed by torch, no atomics). The backward of width 4 without segments walks each tile's tokens in
order instead (`_conv_bwd_walk_kernel`, BWD_WALK): each input and gradient read once, the sums
piled up in each thread, no reduction across a program. With segments, the kernel without them
runs over every tile first, and a second launch recomputes over its output the few tiles that
hold a boundary (most tiles lie in one document: documents are hundreds of tokens), so that only
those pay for the segment and tail reads and their registers (see LAUNCH, SEGMENT_FORM "tiles");
or, the default (SEGMENT_FORM "starts"), a program a lane finds its starts in the segment ids and
mends only what each one changes.
The state after the chunk is formed by the caller's small tensors (`state_after`). Registered
with torch.library.triton_op, so that torch.compile launches the kernels from its own code (no
custom-op host glue) and eager mode calls them directly.

Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .triton_env import FLOAT_DTYPES as _DTYPES
from .triton_env import HAS_TRITON, tl, triton
from .triton_env import INTERPRET as _INTERPRET
from .triton_env import register_autograd, triton_op


def supported(x: Tensor) -> bool:
    """Whether `depthwise_conv` runs on x (CUDA, or CPU under the interpreter; float dtypes)."""
    return HAS_TRITON and (x.is_cuda or _INTERPRET) and x.dtype in _DTYPES


def segment_since(seg: Tensor) -> Tensor:
    """(B, L) int32: how many tokens each token is into its segment (0 at a segment's first)."""
    L = seg.shape[1]
    idx = torch.arange(L, device=seg.device)
    is_start = seg != torch.cat([seg.new_zeros(seg.shape[0], 1), seg[:, :-1]], dim=1)
    return (idx - torch.where(is_start, idx, 0).cummax(1).values).to(torch.int32)


def state_after(x: Tensor, conv_state: Tensor, seg: Tensor | None = None, since: Tensor | None = None,
                tail: Tensor | None = None) -> Tensor:
    """The conv state (B, C, K-1) after the chunk, in conv_state's dtype: the last K-1 inputs of
    [conv_state | x] as the last segment sees them (an input of an earlier segment is zero, or the
    tail's input that the last segment starts after). Only K-1 + K-1 tokens are touched."""
    B, L, C = x.shape
    K1 = conv_state.shape[-1]
    last = torch.cat([conv_state.to(x.dtype), x[:, max(0, L - K1):].transpose(1, 2)], dim=2)[:, :, -K1:]
    if seg is None:
        return last.to(conv_state.dtype)
    seg_last = torch.cat([seg.new_zeros(B, K1), seg[:, max(0, L - K1):]], dim=1)[:, -K1:]
    return last_segment_state(last, seg_last, seg, since, tail).to(conv_state.dtype)


def last_segment_state(last: Tensor, seg_last: Tensor, seg: Tensor, since: Tensor | None,
                       tail: Tensor | None) -> Tensor:
    """The conv state after a chunk from its last K-1 inputs `last` (B, C, K-1) (carried inputs
    first, where the chunk is shorter) and their segment ids `seg_last` (B, K-1), as the chunk's
    last segment sees them: an input of an earlier segment is zero, or with `tail` (C, K-1) the
    tail input that segment starts after (slot k reads tail[k + since[-1] + 1]). In last's dtype;
    shared by `state_after` and `mamba.segment_conv`."""
    same = (seg_last == seg[:, -1:])[:, None]                               # (B, 1, K-1)
    if tail is None:
        return torch.where(same, last, 0.0)
    K1 = last.shape[-1]
    j = torch.arange(K1, device=last.device) + since[:, -1:].long() + 1     # (B, K-1) tail index
    before = torch.zeros_like(last)
    for i in range(K1):
        before = torch.where((j == i)[:, None], tail[:, i, None].to(last.dtype), before)
    return torch.where(same, last, before)


if HAS_TRITON:

    @triton.jit
    def _segments(seg_ptr, since_ptr, b, t, tm, L, HAS_SEG: tl.constexpr, HAS_TAIL: tl.constexpr):
        """The segment ids of tokens t and how far each is into its segment (zeros without)."""
        sg = t * 0
        sn = t * 0
        if HAS_SEG:
            sg = tl.load(seg_ptr + b * L + t, mask=tm, other=0)
        if HAS_TAIL:
            sn = tl.load(since_ptr + b * L + t, mask=tm, other=0)
        return sg, sn

    @triton.jit
    def _tap(x_ptr, st_ptr, tail_ptr, seg_ptr, b, t, c, tm, cm, sg, sn, L, C,
             sxb, sxl, sxc, ssb, ssc, ssk, s: tl.constexpr, K: tl.constexpr,
             HAS_SEG: tl.constexpr, HAS_TAIL: tl.constexpr, FIRST: tl.constexpr):
        """The input that tap s (s tokens back) of outputs t reads, float32 (BL, BC). FIRST: the
        tile may reach back into the carried inputs (its first token is under K-1): only such a
        tile loads them (st: (B, K-1, C), see `_channels_last`)."""
        src = t - s
        m2 = cm[None, :]
        if FIRST:
            inx = src >= 0
            xv = tl.load(x_ptr + b * sxb + src[:, None] * sxl + c[None, :] * sxc,
                         mask=(tm & inx)[:, None] & m2, other=0.0)
            sv = tl.load(st_ptr + b * ssb + c[None, :] * ssc + (K - 1 + src)[:, None] * ssk,
                         mask=(tm & (src < 0))[:, None] & m2, other=0.0)
            v = tl.where(inx[:, None], xv.to(tl.float32), sv.to(xv.dtype).to(tl.float32))
        else:
            xv = tl.load(x_ptr + b * sxb + src[:, None] * sxl + c[None, :] * sxc,
                         mask=tm[:, None] & m2, other=0.0)
            v = xv.to(tl.float32)
        if HAS_SEG:
            sseg = tl.load(seg_ptr + b * L + src, mask=tm & (src >= 0), other=0)
            same = sseg == sg
            if HAS_TAIL:
                inner = (~same) & (sg > 0) & tm
                tv = tl.load(tail_ptr + c[None, :] * (K - 1) + (K - 1 - s + sn)[:, None],
                             mask=inner[:, None] & m2, other=0.0)
                v = tl.where(same[:, None], v, tv.to(xv.dtype).to(tl.float32))
            else:
                v = tl.where(same[:, None], v, 0.0)
        return v

    @triton.jit
    def _one_segment(seg_ptr, b, lb, L, K: tl.constexpr, BL: tl.constexpr, REACH: tl.constexpr):
        """Whether every input tile lb's outputs read (and, with REACH = K-1, every output that
        reads its inputs) lies in one segment that reads no tail: then the tile is computed as if
        there were no segments. Most tiles are (a document is hundreds of tokens); segment ids
        never decrease, so the two ends of the span tell. A span that reaches the carried inputs
        must be the carried document's (segment 0): a later one reads the tail there."""
        t0 = lb * BL
        lo = tl.maximum(t0 - (K - 1), 0)
        hi = tl.minimum(t0 + BL - 1 + REACH, L - 1)
        first = tl.load(seg_ptr + b * L + lo)
        return (first == tl.load(seg_ptr + b * L + hi)) & ((t0 >= K - 1) | (first == 0))

    @triton.jit
    def _conv_fwd_tile(x_ptr, st_ptr, w_ptr, bias_ptr, seg_ptr, since_ptr, tail_ptr, out_ptr,
                       act_ptr, L, C, sxb, sxl, sxc, ssb, ssc, ssk, sob, sol, soc, b, lb,
                       K: tl.constexpr, HAS_SEG: tl.constexpr, HAS_TAIL: tl.constexpr,
                       BL: tl.constexpr, BC: tl.constexpr, FIRST: tl.constexpr, ACT: tl.constexpr):
        t = lb * BL + tl.arange(0, BL)
        c = tl.program_id(2) * BC + tl.arange(0, BC)
        _conv_fwd_rows(x_ptr, st_ptr, w_ptr, bias_ptr, seg_ptr, since_ptr, tail_ptr, out_ptr,
                       act_ptr, L, C, sxb, sxl, sxc, ssb, ssc, ssk, sob, sol, soc, b, t, t < L, c,
                       c < C, K, HAS_SEG, HAS_TAIL, BL, BC, FIRST, ACT)

    @triton.jit
    def _conv_fwd_rows(x_ptr, st_ptr, w_ptr, bias_ptr, seg_ptr, since_ptr, tail_ptr, out_ptr,
                       act_ptr, L, C, sxb, sxl, sxc, ssb, ssc, ssk, sob, sol, soc, b, t, tm, c, cm,
                       K: tl.constexpr, HAS_SEG: tl.constexpr, HAS_TAIL: tl.constexpr,
                       BL: tl.constexpr, BC: tl.constexpr, FIRST: tl.constexpr, ACT: tl.constexpr):
        """Outputs t (BL tokens of lane b where tm) of channels c (BC, where cm), stored."""
        sg, sn = _segments(seg_ptr, since_ptr, b, t, tm, L, HAS_SEG, HAS_TAIL)
        acc = tl.zeros((BL, BC), dtype=tl.float32) + tl.load(bias_ptr + c, mask=cm, other=0.0).to(
            tl.float32)[None, :]
        for s in tl.static_range(K):
            w = tl.load(w_ptr + c * K + (K - 1 - s), mask=cm, other=0.0).to(tl.float32)
            v = _tap(x_ptr, st_ptr, tail_ptr, seg_ptr, b, t, c, tm, cm, sg, sn, L, C,
                     sxb, sxl, sxc, ssb, ssc, ssk, s, K, HAS_SEG, HAS_TAIL, FIRST)
            acc += w[None, :] * v
        out = acc.to(out_ptr.dtype.element_ty)
        off = b * sob + t[:, None] * sol + c[None, :] * soc
        tl.store(out_ptr + off, out, mask=tm[:, None] & cm[None, :])
        if ACT:   # SiLU of the stored (rounded) output, into act (out's strides)
            v = out.to(tl.float32)
            tl.store(act_ptr + off, (v / (1.0 + tl.exp(-v))).to(act_ptr.dtype.element_ty),
                     mask=tm[:, None] & cm[None, :])

    @triton.jit
    def _conv_fwd_kernel(x_ptr, st_ptr, w_ptr, bias_ptr, seg_ptr, since_ptr, tail_ptr, out_ptr,
                         act_ptr, L, C, sxb, sxl, sxc, ssb, ssc, ssk, sob, sol, soc,
                         K: tl.constexpr, HAS_SEG: tl.constexpr, HAS_TAIL: tl.constexpr,
                         BL: tl.constexpr, BC: tl.constexpr, SUB: tl.constexpr, ACT: tl.constexpr):
        """Without HAS_SEG: every tile of BL tokens as if the chunk held one document. With it:
        only the tiles that hold a boundary (see `_launches`), by sub-tiles of SUB tokens in the
        form with segments; the other programs return at once. ACT: also SiLU(out) into act."""
        b = tl.program_id(0)
        lb = tl.program_id(1)
        if HAS_SEG:
            if not _one_segment(seg_ptr, b, lb, L, K, BL, 0):
                for h in tl.static_range(BL // SUB):
                    _conv_fwd_tile(x_ptr, st_ptr, w_ptr, bias_ptr, seg_ptr, since_ptr, tail_ptr,
                                   out_ptr, act_ptr, L, C, sxb, sxl, sxc, ssb, ssc, ssk, sob, sol,
                                   soc, b, lb * (BL // SUB) + h, K, HAS_SEG, HAS_TAIL, SUB, BC, True,
                                   ACT)
        elif lb * BL >= K - 1:   # reads nothing carried
            _conv_fwd_tile(x_ptr, st_ptr, w_ptr, bias_ptr, seg_ptr, since_ptr, tail_ptr,
                           out_ptr, act_ptr, L, C, sxb, sxl, sxc, ssb, ssc, ssk, sob, sol, soc, b,
                           lb, K, False, False, BL, BC, False, ACT)
        else:
            _conv_fwd_tile(x_ptr, st_ptr, w_ptr, bias_ptr, seg_ptr, since_ptr, tail_ptr,
                           out_ptr, act_ptr, L, C, sxb, sxl, sxc, ssb, ssc, ssk, sob, sol, soc, b,
                           lb, K, False, False, BL, BC, True, ACT)

    @triton.jit
    def _conv_bwd_tile(x_ptr, st_ptr, w_ptr, seg_ptr, since_ptr, tail_ptr, g_ptr, a_ptr, dx_ptr,
                       L, C, sxb, sxl, sxc, ssb, ssc, ssk, sgb, sgl, sgc, sdb, sdl, sdc, b, t0,
                       K: tl.constexpr, HAS_SEG: tl.constexpr, HAS_TAIL: tl.constexpr,
                       BL: tl.constexpr, BC: tl.constexpr, KP: tl.constexpr, KW: tl.constexpr,
                       FIRST: tl.constexpr, SILU: tl.constexpr):
        """dx (B, L, C) of the chunk's inputs t0 .. t0 + BL - 1 (stored), and this tile's sums of
        the bias, weight and tail gradients: db (BC,), dw (BC, KW) by weight index, dtail (BC, KP)
        (zeros without a tail)."""
        t = t0 + tl.arange(0, BL)
        c = tl.program_id(2) * BC + tl.arange(0, BC)
        tm, cm = t < L, c < C
        m2 = tm[:, None] & cm[None, :]
        sg, sn = _segments(seg_ptr, since_ptr, b, t, tm, L, HAS_SEG, HAS_TAIL)
        g = _grad(g_ptr, a_ptr, b * sgb + t[:, None] * sgl + c[None, :] * sgc, m2, SILU)
        db = tl.sum(g, axis=0)
        kcol = tl.arange(0, KW)
        dw = tl.zeros((BC, KW), dtype=tl.float32)
        dx = tl.zeros((BL, BC), dtype=tl.float32)
        for s in tl.static_range(K):
            w = tl.load(w_ptr + c * K + (K - 1 - s), mask=cm, other=0.0).to(tl.float32)
            # the weight: what tap s read, times the output's gradient
            v = _tap(x_ptr, st_ptr, tail_ptr, seg_ptr, b, t, c, tm, cm, sg, sn, L, C,
                     sxb, sxl, sxc, ssb, ssc, ssk, s, K, HAS_SEG, HAS_TAIL, FIRST)
            dw += tl.where(kcol[None, :] == K - 1 - s, tl.sum(g * v, axis=0)[:, None], 0.0)
            # the input at t: read by output t + s through tap s, if in the same segment
            ts = t + s
            tsm = ts < L
            gs = _grad(g_ptr, a_ptr, b * sgb + ts[:, None] * sgl + c[None, :] * sgc,
                       (tm & tsm)[:, None] & cm[None, :], SILU)
            if HAS_SEG:
                same = tl.load(seg_ptr + b * L + ts, mask=tm & tsm, other=-1) == sg
                gs = tl.where(same[:, None], gs, 0.0)
            dx += w[None, :] * gs
        tl.store(dx_ptr + b * sdb + t[:, None] * sdl + c[None, :] * sdc,
                 dx.to(dx_ptr.dtype.element_ty), mask=m2)
        col = tl.arange(0, KP)
        dtail = tl.zeros((BC, KP), dtype=tl.float32)
        if HAS_TAIL:
            # tail input i is read by the outputs d = since < K-1 tokens into a segment > 0,
            # through tap s = K-1-i+d, i.e. weight i-d, for every d <= i. So with G_d the sum of
            # those outputs' gradients, dtail_i = sum_{d<=i} w_{i-d} G_d: K-1 reductions of the
            # tile (not (K-1)^2), each spread over the columns i >= d of a (BC, KP) block
            inner = tm & (sg > 0)
            for d in tl.static_range(K - 1):
                gd = tl.sum(tl.where((inner & (sn == d))[:, None], g, 0.0), axis=0)
                wm = cm[:, None] & ((col >= d) & (col < K - 1))[None, :]
                wt = tl.load(w_ptr + c[:, None] * K + (col - d)[None, :], mask=wm, other=0.0)
                dtail += wt.to(tl.float32) * gd[:, None]
        return db, dw, dtail

    @triton.jit
    def _row(ptr, b, t, c, cm, L, sb, sl, sc, st_ptr, ssb, ssc, ssk, K: tl.constexpr,
             CARRIED: tl.constexpr):
        """Row t (BC channels, float32) of a (B, L, C) tensor; zero past L, and with CARRIED the
        carried inputs (st, (B, K-1, C)) for t < 0 (else zero there too)."""
        v = tl.load(ptr + b * sb + t * sl + c * sc, mask=cm & (t >= 0) & (t < L),
                    other=0.0).to(tl.float32)
        if CARRIED:
            sv = tl.load(st_ptr + b * ssb + c * ssc + (K - 1 + t) * ssk, mask=cm & (t < 0),
                         other=0.0).to(tl.float32)
            v = tl.where(t < 0, sv, v)
        return v

    @triton.jit
    def _grad(g_ptr, a_ptr, off, mask, SILU: tl.constexpr):
        """The output's gradient at `off` in float32 (zero where masked). SILU: g_ptr holds the
        gradient w.r.t. SiLU(out) and a_ptr the output out (at the same offsets): times SiLU'(out)
        = s (1 + out (1 - s)), s = sigmoid(out), as it is read."""
        g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
        if SILU:
            v = tl.load(a_ptr + off, mask=mask, other=0.0).to(tl.float32)
            sg = tl.sigmoid(v)
            g = g * sg * (1.0 + v * (1.0 - sg))
        return g

    @triton.jit
    def _conv_bwd_walk_kernel(x_ptr, st_ptr, w_ptr, g_ptr, a_ptr, dx_ptr, dw_ptr, db_ptr,
                              L, C, NL, sxb, sxl, sxc, ssb, ssc, ssk, sgb, sgl, sgc, sdb, sdl, sdc,
                              dx_off, BL: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr):
        """The backward of width 4 without segments, a tile of BL tokens by walking them in
        order: each program's threads own its BC channels and keep the last three inputs and the
        next three output gradients in registers, so that x and g are read once (no tap re-reads
        a shifted tile) and the weight's and bias's sums pile up in each thread (no reduction
        across the program). dx and one slot of partial sums per tile, as `_conv_bwd_kernel`."""
        K: tl.constexpr = 4
        dx_ptr += dx_off   # dx: the columns of a wider gradient this far in (see conv_backward)
        b = tl.program_id(0)
        lb = tl.program_id(1)
        c = tl.program_id(2) * BC + tl.arange(0, BC)
        cm = c < C
        t0 = lb * BL
        w0 = tl.load(w_ptr + c * K + 0, mask=cm, other=0.0).to(tl.float32)
        w1 = tl.load(w_ptr + c * K + 1, mask=cm, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + c * K + 2, mask=cm, other=0.0).to(tl.float32)
        w3 = tl.load(w_ptr + c * K + 3, mask=cm, other=0.0).to(tl.float32)
        # inputs t-3, t-2, t-1 (the carried ones before the chunk) and gradients t, t+1, t+2
        xa = _row(x_ptr, b, t0 - 3, c, cm, L, sxb, sxl, sxc, st_ptr, ssb, ssc, ssk, K, True)
        xb = _row(x_ptr, b, t0 - 2, c, cm, L, sxb, sxl, sxc, st_ptr, ssb, ssc, ssk, K, True)
        xc = _row(x_ptr, b, t0 - 1, c, cm, L, sxb, sxl, sxc, st_ptr, ssb, ssc, ssk, K, True)
        gm = cm & (t0 < L)
        ga = _grad(g_ptr, a_ptr, b * sgb + t0 * sgl + c * sgc, gm, SILU)
        gm = cm & (t0 + 1 < L)
        gb = _grad(g_ptr, a_ptr, b * sgb + (t0 + 1) * sgl + c * sgc, gm, SILU)
        gm = cm & (t0 + 2 < L)
        gc = _grad(g_ptr, a_ptr, b * sgb + (t0 + 2) * sgl + c * sgc, gm, SILU)
        d0 = tl.zeros((BC,), dtype=tl.float32)
        d1 = tl.zeros((BC,), dtype=tl.float32)
        d2 = tl.zeros((BC,), dtype=tl.float32)
        d3 = tl.zeros((BC,), dtype=tl.float32)
        db = tl.zeros((BC,), dtype=tl.float32)
        for i in range(BL):
            t = t0 + i
            xt = _row(x_ptr, b, t, c, cm, L, sxb, sxl, sxc, st_ptr, ssb, ssc, ssk, K, False)
            gd = _grad(g_ptr, a_ptr, b * sgb + (t + 3) * sgl + c * sgc, cm & (t + 3 < L), SILU)
            # output t = sum_s w[3-s] x[t-s]: its gradient ga goes to w[3-s] times x[t-s]
            d3 += ga * xt
            d2 += ga * xc
            d1 += ga * xb
            d0 += ga * xa
            db += ga
            # input t is read by outputs t .. t+3 through w[3], w[2], w[1], w[0]
            dx = w3 * ga + w2 * gb + w1 * gc + w0 * gd
            tl.store(dx_ptr + b * sdb + t * sdl + c * sdc, dx.to(dx_ptr.dtype.element_ty),
                     mask=cm & (t < L))
            xa, xb, xc = xb, xc, xt
            ga, gb, gc = gb, gc, gd
        part = (b * NL + lb).to(tl.int64)
        tl.store(db_ptr + part * C + c, db, mask=cm)
        base = dw_ptr + (part * C + c) * K
        tl.store(base + 0, d0, mask=cm)
        tl.store(base + 1, d1, mask=cm)
        tl.store(base + 2, d2, mask=cm)
        tl.store(base + 3, d3, mask=cm)

    @triton.jit
    def _store_sums(dw_ptr, db_ptr, dtail_ptr, part, C, db, dw, dtail, K: tl.constexpr,
                    BC: tl.constexpr, KP: tl.constexpr, KW: tl.constexpr, TAIL: tl.constexpr):
        """A tile's partial sums into slot `part` of dw (P, C, K), db (P, C), dtail (P, C, K-1)."""
        c = tl.program_id(2) * BC + tl.arange(0, BC)
        cm = c < C
        tl.store(db_ptr + part * C + c, db, mask=cm)
        kcol = tl.arange(0, KW)
        tl.store(dw_ptr + (part * C + c)[:, None] * K + kcol[None, :], dw,
                 mask=cm[:, None] & (kcol < K)[None, :])
        if TAIL:
            col = tl.arange(0, KP)
            tl.store(dtail_ptr + (part * C + c)[:, None] * (K - 1) + col[None, :], dtail,
                     mask=cm[:, None] & (col < K - 1)[None, :])

    @triton.jit
    def _conv_bwd_kernel(x_ptr, st_ptr, w_ptr, seg_ptr, since_ptr, tail_ptr, g_ptr, a_ptr, dx_ptr,
                         dw_ptr, db_ptr, dtail_ptr,
                         L, C, NL, sxb, sxl, sxc, ssb, ssc, ssk, sgb, sgl, sgc, sdb, sdl, sdc,
                         dx_off, K: tl.constexpr, HAS_SEG: tl.constexpr, HAS_TAIL: tl.constexpr,
                         BL: tl.constexpr, BC: tl.constexpr, KP: tl.constexpr, KW: tl.constexpr,
                         SUB: tl.constexpr, SILU: tl.constexpr):
        """dx, and one slot of partial sums per tile of BL tokens: dw (B * NL, C, K), db (B * NL,
        C), dtail (B * NL, C, K-1). Which tiles as in `_conv_fwd_kernel` (with HAS_SEG, the sums of
        a tile's SUB-token sub-tiles added up). Deterministic: no atomics, the caller sums the
        slots."""
        dx_ptr += dx_off
        b = tl.program_id(0)
        lb = tl.program_id(1)
        part = (b * NL + lb).to(tl.int64)
        if HAS_SEG:   # the inputs' gradients reach the outputs K-1 tokens on
            if not _one_segment(seg_ptr, b, lb, L, K, BL, K - 1):
                db = tl.zeros((BC,), dtype=tl.float32)
                dw = tl.zeros((BC, KW), dtype=tl.float32)
                dtail = tl.zeros((BC, KP), dtype=tl.float32)
                for h in tl.static_range(BL // SUB):
                    a, w, d = _conv_bwd_tile(
                        x_ptr, st_ptr, w_ptr, seg_ptr, since_ptr, tail_ptr, g_ptr, a_ptr, dx_ptr,
                        L, C, sxb, sxl, sxc, ssb, ssc, ssk, sgb, sgl, sgc, sdb, sdl, sdc, b,
                        lb * BL + h * SUB, K, HAS_SEG, HAS_TAIL, SUB, BC, KP, KW, True, SILU)
                    db += a
                    dw += w
                    dtail += d
                _store_sums(dw_ptr, db_ptr, dtail_ptr, part, C, db, dw, dtail, K, BC, KP, KW,
                            HAS_TAIL)
        elif lb * BL >= K - 1:   # reads nothing carried
            db, dw, dtail = _conv_bwd_tile(
                x_ptr, st_ptr, w_ptr, seg_ptr, since_ptr, tail_ptr, g_ptr, a_ptr, dx_ptr,
                L, C, sxb, sxl, sxc, ssb, ssc, ssk, sgb, sgl, sgc, sdb, sdl, sdc, b, lb * BL,
                K, False, False, BL, BC, KP, KW, False, SILU)
            _store_sums(dw_ptr, db_ptr, dtail_ptr, part, C, db, dw, dtail, K, BC, KP, KW, False)
        else:
            db, dw, dtail = _conv_bwd_tile(
                x_ptr, st_ptr, w_ptr, seg_ptr, since_ptr, tail_ptr, g_ptr, a_ptr, dx_ptr,
                L, C, sxb, sxl, sxc, ssb, ssc, ssk, sgb, sgl, sgc, sdb, sdl, sdc, b, lb * BL,
                K, False, False, BL, BC, KP, KW, True, SILU)
            _store_sums(dw_ptr, db_ptr, dtail_ptr, part, C, db, dw, dtail, K, BC, KP, KW, False)

    @triton.jit
    def _conv_fwd_fix_kernel(x_ptr, st_ptr, w_ptr, bias_ptr, seg_ptr, since_ptr, tail_ptr,
                             out_ptr, act_ptr, L, C, sxb, sxl, sxc, ssb, ssc, ssk, sob, sol, soc,
                             K: tl.constexpr, HAS_TAIL: tl.constexpr, BT: tl.constexpr,
                             BC: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr,
                             ACT: tl.constexpr):
        """Over the plain kernel's output, lane program_id(0): at each segment start p, found by
        reading the lane's segment ids, the K-1 outputs p .. p+K-2 recomputed in the form with
        segments (only they read across a start; where two starts are closer than K-1 tokens,
        both write the same values). No list and no bound on the number of starts."""
        b = tl.program_id(0)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = c < C
        for j in range(NB):
            # the block's starts: a segment id other than the token's before (at 0, the carried
            # 0), read here, not by a helper: a store address derived from a helper's result is
            # taken by torch.compile's analysis as a write of every pointer the helper was given
            # (tests/test_kernel_writes.py); each next start is the least one past the last
            tok = j * BS + tl.arange(0, BS)
            sg = tl.load(seg_ptr + b * L + tok, mask=tok < L, other=0)
            before = tl.load(seg_ptr + b * L + tok - 1, mask=(tok < L) & (tok > 0), other=0)
            first = (tok < L) & (sg != before)
            p = tl.min(tl.where(first, tok, L))
            while p < L:
                t = p + tl.arange(0, BT)
                _conv_fwd_rows(x_ptr, st_ptr, w_ptr, bias_ptr, seg_ptr, since_ptr, tail_ptr,
                               out_ptr, act_ptr, L, C, sxb, sxl, sxc, ssb, ssc, ssk, sob, sol, soc,
                               b, t, (t < p + K - 1) & (t < L), c, cm, K, True, HAS_TAIL, BT, BC,
                               True, ACT)
                p = tl.min(tl.where(first & (tok > p), tok, L))

    @triton.jit
    def _fix_bwd_at(x_ptr, st_ptr, w_ptr, seg_ptr, tail_ptr, g_ptr, a_ptr, dx_ptr, L,
                    sxb, sxl, sxc, ssb, ssc, ssk, sgb, sgl, sgc, sdb, sdl, sdc, b, p, c, cm,
                    K: tl.constexpr, HAS_TAIL: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                    KP: tl.constexpr, KW: tl.constexpr, SILU: tl.constexpr):
        """For the start p of lane b: dx of the K-1 inputs before p recomputed in the form with
        segments (only they are read by outputs across the start), and what the start changes in
        the weight and tail gradients through the outputs p .. p+K-2 of its segment: each tap
        that reaches before p read zero or the tail there, not the input the plain kernel took.
        Returns (dw change (BC, KW) by weight index, dtail (BC, KP))."""
        kcol = tl.arange(0, KW)
        col = tl.arange(0, KP)
        dw = tl.zeros((BC, KW), dtype=tl.float32)
        dtail = tl.zeros((BC, KP), dtype=tl.float32)
        i = tl.arange(0, BT)
        # the inputs u = p-K+1 .. p-1: read by outputs u + s of their own segment only
        u = p - (K - 1) + i
        um = (i < K - 1) & (u >= 0)
        su = tl.load(seg_ptr + b * L + u, mask=um, other=0)
        dx = tl.zeros((BT, BC), dtype=tl.float32)
        for s in tl.static_range(K):
            us = u + s
            ok = um & (us < L)
            same = tl.load(seg_ptr + b * L + us, mask=ok, other=-1) == su
            gs = _grad(g_ptr, a_ptr, b * sgb + us[:, None] * sgl + c[None, :] * sgc,
                       (ok & same)[:, None] & cm[None, :], SILU)
            w = tl.load(w_ptr + c * K + (K - 1 - s), mask=cm, other=0.0).to(tl.float32)
            dx += w[None, :] * gs
        tl.store(dx_ptr + b * sdb + u[:, None] * sdl + c[None, :] * sdc,
                 dx.to(dx_ptr.dtype.element_ty), mask=um[:, None] & cm[None, :])
        # the outputs t = p .. p+K-2 of this segment: tap s reads t - s; before p the plain
        # kernel took x (or the carried inputs), the segment reads zero or tail[K-1-s+t-p]
        t = p + i
        tm = (i < K - 1) & (t < L)
        tm = tm & (tl.load(seg_ptr + b * L + t, mask=tm, other=-1) == tl.load(seg_ptr + b * L + p))
        g = _grad(g_ptr, a_ptr, b * sgb + t[:, None] * sgl + c[None, :] * sgc,
                  tm[:, None] & cm[None, :], SILU)
        for s in tl.static_range(1, K):
            src = t - s
            before = tm & (src < p)
            xv = tl.load(x_ptr + b * sxb + src[:, None] * sxl + c[None, :] * sxc,
                         mask=(before & (src >= 0))[:, None] & cm[None, :], other=0.0)
            sv = tl.load(st_ptr + b * ssb + c[None, :] * ssc + (K - 1 + src)[:, None] * ssk,
                         mask=(before & (src < 0))[:, None] & cm[None, :], other=0.0)
            took = tl.where((src >= 0)[:, None], xv.to(tl.float32), sv.to(xv.dtype).to(tl.float32))
            read = tl.zeros((BT, BC), dtype=tl.float32)
            if HAS_TAIL:
                j = K - 1 - s + i                              # the tail input, < K-1 before p
                tv = tl.load(tail_ptr + c[None, :] * (K - 1) + j[:, None],
                             mask=before[:, None] & cm[None, :], other=0.0)
                read = tv.to(xv.dtype).to(tl.float32)
                w = tl.load(w_ptr + c * K + (K - 1 - s), mask=cm, other=0.0).to(tl.float32)
                gw = tl.where(before[:, None], g * w[None, :], 0.0)
                for jj in tl.static_range(K - 1):
                    sj = tl.sum(tl.where((j == jj)[:, None], gw, 0.0), axis=0)
                    dtail += tl.where(col[None, :] == jj, sj[:, None], 0.0)
            delta = tl.sum(tl.where(before[:, None], g * (read - took), 0.0), axis=0)
            dw += tl.where(kcol[None, :] == K - 1 - s, delta[:, None], 0.0)
        return dw, dtail

    @triton.jit
    def _conv_bwd_fix_kernel(x_ptr, st_ptr, w_ptr, seg_ptr, tail_ptr, g_ptr, a_ptr, dx_ptr, dw_ptr,
                             dtail_ptr, L, C, sxb, sxl, sxc, ssb, ssc, ssk, sgb, sgl, sgc,
                             sdb, sdl, sdc, dx_off, K: tl.constexpr, HAS_TAIL: tl.constexpr,
                             BT: tl.constexpr, BC: tl.constexpr, KP: tl.constexpr,
                             KW: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr,
                             SILU: tl.constexpr):
        """Over the plain backward, lane program_id(0): `_fix_bwd_at` at each of its segment
        starts; the weight and tail gradients' changes summed into the lane's slot of dw (B, C, K)
        and dtail (B, C, K-1) (zeros for a lane without a start)."""
        dx_ptr += dx_off
        b = tl.program_id(0)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = c < C
        dw = tl.zeros((BC, KW), dtype=tl.float32)
        dtail = tl.zeros((BC, KP), dtype=tl.float32)
        for j in range(NB):
            # the block's starts, as in _conv_fwd_fix_kernel
            tok = j * BS + tl.arange(0, BS)
            sg = tl.load(seg_ptr + b * L + tok, mask=tok < L, other=0)
            before = tl.load(seg_ptr + b * L + tok - 1, mask=(tok < L) & (tok > 0), other=0)
            first = (tok < L) & (sg != before)
            p = tl.min(tl.where(first, tok, L))
            while p < L:
                a, d = _fix_bwd_at(x_ptr, st_ptr, w_ptr, seg_ptr, tail_ptr, g_ptr, a_ptr, dx_ptr,
                                   L, sxb, sxl, sxc, ssb, ssc, ssk, sgb, sgl, sgc, sdb, sdl, sdc,
                                   b, p, c, cm, K, HAS_TAIL, BT, BC, KP, KW, SILU)
                dw += a
                dtail += d
                p = tl.min(tl.where(first & (tok > p), tok, L))
        slot = b.to(tl.int64) * C + c
        kcol = tl.arange(0, KW)
        tl.store(dw_ptr + slot[:, None] * K + kcol[None, :], dw,
                 mask=cm[:, None] & (kcol < K)[None, :])
        if HAS_TAIL:
            col = tl.arange(0, KP)
            tl.store(dtail_ptr + slot[:, None] * (K - 1) + col[None, :], dtail,
                     mask=cm[:, None] & (col < K - 1)[None, :])

    @triton.jit
    def _conv_dstate_kernel(g_ptr, a_ptr, w_ptr, seg_ptr, ds_ptr, L, C, sgb, sgl, sgc,
                            K: tl.constexpr, HAS_SEG: tl.constexpr, BC: tl.constexpr,
                            SILU: tl.constexpr):
        """The carried inputs' gradient, lane program_id(0), BC channels: input i of the state
        (position i - (K-1)) is read by outputs t = i - (K-1) + s < L through tap s, where t is
        in the carried document (segment 0). ds (B, C, K-1) float32; g read in its dtype, as the
        conv's backward reads it (so a compiled graph need not keep a float32 copy of g)."""
        b = tl.program_id(0)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = c < C
        for i in tl.static_range(K - 1):
            acc = tl.zeros([BC], dtype=tl.float32)
            for s in tl.static_range(K - 1 - i, K):
                t = i - (K - 1) + s
                m = cm & (t < L)
                if HAS_SEG:
                    m = m & (tl.load(seg_ptr + b * L + t, mask=t < L, other=1) == 0)
                gv = _grad(g_ptr, a_ptr, b * sgb + t * sgl + c * sgc, m, SILU)
                acc += gv * tl.load(w_ptr + c * K + (K - 1 - s), mask=cm, other=0.0).to(tl.float32)
            tl.store(ds_ptr + (b.to(tl.int64) * C + c) * (K - 1) + i, acc, mask=cm)

# (tokens, channels, warps) per program on the GPU, forward and backward. With segments the chunk
# takes two launches: the kernel without segments over every tile (exactly the unpacked path's
# kernel), then one over the same tiles that recomputes, over the first one's output, only the few
# tiles that hold a boundary, by sub-tiles of "fwd_seg" / "bwd_seg" tokens (a divisor of the plain
# tile; its channels and warps are its own). Set from `kernels.py conv-launch [--segments]`.
# One launch for both forms (a branch per tile) cost every tile the boundary form's registers
# (backward, 32 tokens: 255 against 134), and so did a launch of the plain tiles alone that checked
# each tile's segments (2026-11-25). H100, a boundary every ~1,000 tokens (packed log-normal
# documents of median 600): backward 287 -> 234 us, forward 58 -> 56; every ~150 tokens it is
# slower, 311 -> 322 and 63 -> 71 (kernels.py conv-launch --segments --every N --before,
# 2026-11-25).
# Looking at several tiles a program in the second launch was slower still (279 and 384 us).
LAUNCH = {"fwd": (32, 128, 4), "bwd": (64, 128, 4), "fwd_seg": (32, 128, 4), "bwd_seg": (32, 128, 4)}


# (channels, warps) a program of the width-4 backward without segments, which walks a tile's
# tokens in order (`_conv_bwd_walk_kernel`; the tile's tokens are LAUNCH["bwd"]'s); None, or
# another width: the tile kernel. H100, the recipe's chunk (32 lanes x 528 tokens x 1,152 channels, bf16),
# the backward op as a CUDA graph: 180.4 -> 123.1 us at (128, 2) and 64 tokens (129.1 at 256
# channels, 150.6 at 64; 152.6 at 32 tokens), dx equal to 7e-6 and dw to 9e-5 relative (summed in
# another order). The forward walked the same way was slower than its tile kernel (74.6 against
# 61.4 us with the SiLU), so it stays tiled.
BWD_WALK = (128, 2)

# The SiLU form's backward: the kernels multiply the activation's gradient by SiLU'(out) as they
# read it (`_grad`), where it was a pass of its own (fused by a compiled graph with whatever
# formed the gradient: in the Mamba block, the concatenation of the scan's dx, dB and dC, which
# the scan now writes as one tensor). False: that pass in PyTorch ops.
SILU_IN_KERNELS = True


def _blocks(backward: bool, boundary: bool) -> tuple[int, int, int]:
    """(tokens, channels, warps) per program: small tiles under the interpreter (16 tokens, the
    boundary form by sub-tiles of 8), LAUNCH on the GPU."""
    if _INTERPRET:
        return (8 if boundary else 16), 16, 4
    return LAUNCH[("bwd" if backward else "fwd") + ("_seg" if boundary else "")]


def _launches(backward: bool, has_seg: bool) -> list[tuple[bool, int, int, int, int]]:
    """(segments, tile tokens, sub-tile tokens, channels, warps) of each launch, in order: every
    tile without segments; with segments, then the tiles that hold a boundary again, over it."""
    BL, BC, warps = _blocks(backward, False)
    launches = [(False, BL, BL, BC, warps)]
    if has_seg:
        sub, sub_bc, sub_warps = _blocks(backward, True)
        if BL % sub:
            raise ValueError(f"conv launch: the boundary sub-tile ({sub} tokens) must divide the "
                             f"plain tile ({BL})")
        launches.append((True, BL, sub, sub_bc, sub_warps))
    return launches


# How a chunk with segments is computed over the plain launch (the kernel without segments over
# every tile): "tiles", a second launch recomputes the tiles that hold a boundary; "starts", a
# program a lane finds the lane's starts in its segment ids and mends only what a start changes
# (the K-1 outputs after it, the K-1 inputs' gradients before it, the weight and tail gradients
# through those outputs). Measured by benchmarks/gpu.sh conv-forms (H100, 2026-11-26, the
# recipe's chunk, three turns): the op, a boundary every ~1,000 tokens, forward 73 -> 67 us and
# backward 179 -> 154; every ~150, 92 -> 83 and 271 -> 210; the packed training step 49.47 ->
# 49.14 ms (two rounds each, in turns). (An earlier form with the starts in a list made on the
# device, one program a start, was a faster op still but no faster step: the list was made in
# the graph for every layer.)
SEGMENT_FORM = "starts"
# (channels, warps) a program of the "starts" kernels; the lane's segment ids are read BS at a time
FIX = (128, 4)


def _fix_blocks(L: int) -> tuple[int, int, int]:
    """(channels, warps, BS) of the "starts" kernels: small under the interpreter. A lane's
    segment ids are read in NB = cdiv(L, BS) blocks (a constant of the kernel)."""
    if _INTERPRET:
        return 16, 1, 16
    return FIX + (min(triton.next_power_of_2(L), 1024),)


def _channels_last(conv_state: Tensor) -> Tensor:
    """The carried inputs (B, C, K-1) as (B, K-1, C), contiguous: the kernels read them like the
    chunk's inputs, a row of channels at a time (a tiny copy; read in place, strided along the
    channels, each element was a load of its own, and their addresses alone filled a program's
    registers: 255 and spilling, against 126 now at the launch in use)."""
    return conv_state.transpose(1, 2).contiguous()


def _args(x, seg, since, tail):
    """The kernels' segment, since and tail pointers (a dummy where absent) and their flags."""
    has_seg, has_tail = seg is not None, tail is not None
    dummy = x.new_zeros(1, dtype=torch.int32)
    return (seg if has_seg else dummy, since if has_tail else dummy,
            tail if has_tail else x.new_zeros(1), has_seg, has_tail)


def _conv_fwd(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor, seg: Tensor | None,
              since: Tensor | None, tail: Tensor | None, act: Tensor | None,
              mend: bool = False) -> Tensor:
    B, L, C = x.shape
    K = weight.shape[-1]
    out = torch.empty(B, L, C, device=x.device, dtype=x.dtype)
    seg_, since_, tail_, has_seg, has_tail = _args(x, seg, since, tail)
    st = _channels_last(conv_state)
    fix = has_seg and mend
    for segments, BL, sub, BC, warps in _launches(False, has_seg and not fix):
        grid = (B, triton.cdiv(L, BL), triton.cdiv(C, BC))
        torch.library.wrap_triton(_conv_fwd_kernel)[grid](
            x, st, weight, bias, seg_, since_, tail_, out, out if act is None else act, L, C,
            x.stride(0), x.stride(1), x.stride(2), st.stride(0), st.stride(2), st.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            K=K, HAS_SEG=segments, HAS_TAIL=segments and has_tail, BL=BL, BC=BC, SUB=sub,
            ACT=act is not None, num_warps=warps)
    if fix:
        BC, warps, BS = _fix_blocks(L)
        torch.library.wrap_triton(_conv_fwd_fix_kernel)[(B, triton.cdiv(C, BC))](
            x, st, weight, bias, seg_, since_, tail_, out, out if act is None else act,
            L, C, x.stride(0), x.stride(1), x.stride(2), st.stride(0), st.stride(2), st.stride(1),
            out.stride(0), out.stride(1), out.stride(2), K=K, HAS_TAIL=has_tail,
            BT=triton.next_power_of_2(K - 1), BC=BC, BS=BS, NB=triton.cdiv(L, BS),
            ACT=act is not None, num_warps=warps)
    return out


@triton_op("elephant::depthwise_conv", mutates_args=())
def _conv_op(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor, seg: Tensor | None,
             since: Tensor | None, tail: Tensor | None, mend: bool = False) -> Tensor:
    return _conv_fwd(x, conv_state, weight, bias, seg, since, tail, None, mend)


@triton_op("elephant::depthwise_conv_silu", mutates_args=())
def _conv_silu_op(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor, seg: Tensor | None,
                  since: Tensor | None, tail: Tensor | None, mend: bool = False
                  ) -> tuple[Tensor, Tensor]:
    """(out, SiLU(out)) from one pass: the Mamba block's activation written beside the conv's
    output instead of read back from it by a kernel of its own."""
    act = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    return _conv_fwd(x, conv_state, weight, bias, seg, since, tail, act, mend), act


@triton_op("elephant::depthwise_conv_backward", mutates_args=())
def _conv_bwd_op(g: Tensor, x: Tensor, conv_state: Tensor, weight: Tensor, seg: Tensor | None,
                 since: Tensor | None, tail: Tensor | None, mend: bool = False,
                 out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dstate, dw, db, dtail) from g, the gradient of the conv's output, or with `out` (the
    conv's output) of SiLU(out): every kernel then takes g times SiLU'(out) as it reads g (no pass
    of its own for it; g and out read at the same offsets, both contiguous)."""
    return conv_backward(g, x, conv_state, weight, seg, since, tail, mend, out)


def conv_backward(g: Tensor, x: Tensor, conv_state: Tensor, weight: Tensor, seg: Tensor | None,
                  since: Tensor | None, tail: Tensor | None, mend: bool = False,
                  out: Tensor | None = None, into: Tensor | None = None, col: int = 0
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`_conv_bwd_op`'s body. `into`: None, or a (B, L, >= col + C) tensor whose columns col ..
    col + C receive dx (the kernels are given `into` itself and the offset, not a view of it, so
    that a compiled graph sees them write `into` and nothing else); dx is then `into`."""
    B, L, C = x.shape
    silu = out is not None
    if silu:
        g, out = g.contiguous(), out.contiguous()
    act = out if silu else g
    K = weight.shape[-1]
    seg_, since_, tail_, has_seg, has_tail = _args(x, seg, since, tail)
    fix = has_seg and mend
    launches = _launches(True, has_seg and not fix)
    BL = launches[0][1]   # the tiles: one slot of partial sums each
    NL = triton.cdiv(L, BL)
    P = B * NL
    dx = torch.empty(B, L, C, device=x.device, dtype=x.dtype) if into is None else into
    dx_off = 0 if into is None else col
    dw = torch.empty(P, C, K, device=x.device, dtype=torch.float32)
    db = torch.empty(P, C, device=x.device, dtype=torch.float32)
    # "tiles": only the tiles with a boundary write theirs (a tile without one reads no tail);
    # "starts": one slot a lane, each written
    n_tail = (B if fix else P) if has_tail else 1
    dtail = (torch.empty if fix and has_tail else torch.zeros)(n_tail, C, K - 1, device=x.device,
                                                              dtype=torch.float32)
    st = _channels_last(conv_state)
    for segments, _, sub, BC, warps in launches:
        if not segments and K == 4 and BWD_WALK is not None:   # every tile, walked in order
            wbc, wwarps = (16, 1) if _INTERPRET else BWD_WALK
            torch.library.wrap_triton(_conv_bwd_walk_kernel)[(B, NL, triton.cdiv(C, wbc))](
                x, st, weight, g, act, dx, dw, db, L, C, NL,
                x.stride(0), x.stride(1), x.stride(2), st.stride(0), st.stride(2), st.stride(1),
                g.stride(0), g.stride(1), g.stride(2), dx.stride(0), dx.stride(1), dx.stride(2),
                dx_off, BL=BL, BC=wbc, SILU=silu, num_warps=wwarps)
            continue
        grid = (B, NL, triton.cdiv(C, BC))
        torch.library.wrap_triton(_conv_bwd_kernel)[grid](
            x, st, weight, seg_, since_, tail_, g, act, dx, dw, db, dtail, L, C, NL,
            x.stride(0), x.stride(1), x.stride(2), st.stride(0), st.stride(2), st.stride(1),
            g.stride(0), g.stride(1), g.stride(2), dx.stride(0), dx.stride(1), dx.stride(2),
            dx_off, K=K, HAS_SEG=segments, HAS_TAIL=segments and has_tail, BL=BL, BC=BC,
            KP=triton.next_power_of_2(K - 1), KW=triton.next_power_of_2(K), SUB=sub, SILU=silu,
            num_warps=warps)
    if fix:   # over the plain launch: what each start changes, a program a lane
        BC, warps, BS = _fix_blocks(L)
        dw_fix = torch.empty(B, C, K, device=x.device, dtype=torch.float32)
        torch.library.wrap_triton(_conv_bwd_fix_kernel)[(B, triton.cdiv(C, BC))](
            x, st, weight, seg_, tail_, g, act, dx, dw_fix, dtail, L, C,
            x.stride(0), x.stride(1), x.stride(2), st.stride(0), st.stride(2), st.stride(1),
            g.stride(0), g.stride(1), g.stride(2), dx.stride(0), dx.stride(1), dx.stride(2),
            dx_off, K=K, HAS_TAIL=has_tail, BT=triton.next_power_of_2(K - 1), BC=BC,
            KP=triton.next_power_of_2(K - 1), KW=triton.next_power_of_2(K), BS=BS,
            NB=triton.cdiv(L, BS), SILU=silu, num_warps=warps)
    # the carried inputs' gradient (_conv_dstate_kernel)
    dstate = torch.empty(B, C, K - 1, device=x.device, dtype=torch.float32)
    DBC = 32 if _INTERPRET else 128
    torch.library.wrap_triton(_conv_dstate_kernel)[(B, triton.cdiv(C, DBC))](
        g, act, weight, seg_, dstate, L, C, g.stride(0), g.stride(1), g.stride(2), K=K,
        HAS_SEG=has_seg, BC=DBC, SILU=silu, num_warps=1 if _INTERPRET else 4)
    dw = dw.sum(0)
    if fix:
        dw = dw + dw_fix.sum(0)
    return dx, dstate, dw, db.sum(0), dtail.sum(0)


def _conv_setup(ctx, inputs, output, keep_out: bool = False):
    x, conv_state, weight, bias, seg, since, tail, mend = inputs
    out = (output[0],) if keep_out else ()   # the SiLU form's derivative reads the conv's output
    ctx.save_for_backward(x, conv_state, weight, seg, since, tail, *out)
    ctx.mend = mend
    ctx.dtypes = (conv_state.dtype, weight.dtype, bias.dtype,
                  None if tail is None else tail.dtype)


def _conv_grad(ctx, g, out=None):
    x, conv_state, weight, seg, since, tail = ctx.saved_tensors[:6]
    dx, dstate, dw, db, dtail = _conv_bwd_op(g, x, conv_state, weight, seg, since, tail, ctx.mend,
                                             out)
    st, wt, bt, tt = ctx.dtypes
    return (dx, dstate.to(st), dw.view(weight.shape).to(wt), db.to(bt), None, None,
            None if tail is None else dtail.to(tt), None)


register_autograd(_conv_op, _conv_grad, setup_context=_conv_setup)


def _conv_silu_setup(ctx, inputs, output):
    _conv_setup(ctx, inputs, output, keep_out=True)
    ctx.silu_in_kernels = SILU_IN_KERNELS
    ctx.set_materialize_grads(False)   # an output without a gradient comes as None, not zeros


def _conv_silu_grad(ctx, g_out, g_act):
    """The gradient reaching the conv's output: g_act through SiLU'(v) = s (1 + v (1 - s)),
    s = sigmoid(v), in float32, taken by the backward's kernels as they read g_act when only the
    activation has a gradient (the Mamba block); else g_out plus that, formed in PyTorch ops
    first."""
    out = ctx.saved_tensors[6]
    if g_out is None and g_act is not None and ctx.silu_in_kernels:
        return _conv_grad(ctx, g_act, out)
    v = out.float()
    g = None if g_out is None else g_out.float()
    if g_act is not None:
        s = torch.sigmoid(v)
        ga = g_act.float() * s * (1.0 + v * (1.0 - s))
        g = ga if g is None else g + ga
    if g is None:
        g = torch.zeros_like(v)
    return _conv_grad(ctx, g.to(out.dtype))


register_autograd(_conv_silu_op, _conv_silu_grad,
                  setup_context=_conv_silu_setup)


def segment_args(seg: Tensor | None, tail: Tensor | None, form: str | None
                 ) -> tuple[Tensor | None, Tensor | None, Tensor | None, bool]:
    """(seg, since, tail, mend) as the ops take them: the segment ids int32 and contiguous, how
    far each token is into its segment (only with a tail), the tail contiguous, and whether the
    segments are mended at each start (`form` "starts") rather than by their tiles ("tiles");
    form None is SEGMENT_FORM."""
    form = form or SEGMENT_FORM
    if form not in ("tiles", "starts"):
        raise ValueError(f"depthwise_conv: form must be 'tiles' or 'starts', got {form!r}")
    tail = None if tail is None else tail.contiguous()
    since = None
    if seg is not None:
        seg = seg.to(torch.int32).contiguous()
        if tail is not None:
            since = segment_since(seg)
    return seg, since, tail, seg is not None and form == "starts"


def depthwise_conv(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor,
                   seg: Tensor | None = None, tail: Tensor | None = None,
                   silu: bool = False, form: str | None = None) -> tuple[Tensor, Tensor]:
    """The conv's output (B, L, C) in x's dtype and the state after the chunk (B, C, K-1) in
    conv_state's dtype (see the module docstring). `silu`: the output's SiLU instead, computed by
    the same kernel (F.silu of the output; its backward through the conv's saved output).
    `form`: how segments are computed, "tiles" or "starts" (default SEGMENT_FORM)."""
    if not supported(x):
        raise RuntimeError(f"depthwise_conv needs Triton and a CUDA tensor (or TRITON_INTERPRET=1) "
                           f"of float32/bfloat16/float16, got {x.device} {x.dtype}")
    if not weight.is_contiguous():
        raise ValueError("depthwise_conv: weight must be contiguous (C, 1, K)")
    seg, since, tail, mend = segment_args(seg, tail, form)
    if silu:
        out = _conv_silu_op(x, conv_state, weight, bias, seg, since, tail, mend)[1]
    else:
        out = _conv_op(x, conv_state, weight, bias, seg, since, tail, mend)
    return out, state_after(x, conv_state, seg, since, tail)
