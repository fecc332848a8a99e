"""Triton kernels for the chunked SSD scan (forward and backward), held equal to `ssd.ssd_chunked`.

The algorithm is ssd_chunked's, per (batch, head) and chunk c of Q tokens with the in-chunk cumulative
log-decay cs_i = sum_{k <= i} dt_k A (formed before the scan kernels, in PyTorch or, with boundaries,
by its own small kernel; it is tiny, and autograd carries the gradient of cs back into dt and A):

    forward
      states      H_0 = initial state;  H_{c+1} = exp(cs_end) H_c + S_c,
                  S_c = sum_j exp(cs_end - cs_j) dt_j x_j B_j^T (P, N);  final = H_C
      chunk_scan  y_i = sum_{j <= i} exp(cs_i - cs_j) (C_i . B_j) dt_j x_j + exp(cs_i) H_c C_i + D x_i
    backward (G_c = dLoss/dH_c)
      states      G_C = dfinal;  G_c = exp(cs_end) G_{c+1} + sum_i exp(cs_i) dy_i C_i^T;  dinit = G_0
      chunk_scan  everything else for one chunk in one program, given dS_c = G_{c+1} and H_c:
                  dx, ddt, dcs (with cs_end's share exp(cs_end) <G_{c+1}, H_c>), dB, dC, dD

The state kernels walk each lane's chunks in order (backward: from the last), one program per
(rows of P, lane, head) holding its part of the state in registers: S_c and the backward's per-chunk
sums are formed and added on the way, never written (the states entering the chunks, H_c, and the
gradients G_{c+1} are written once each, for the chunk scan). The chunk-scan kernels hold one
whole chunk each (Q x P, Q x N, Q x Q tiles), so there are no cross-program reductions except those
over heads sharing a B/C group and over chunks for D (summed in PyTorch, deterministic). Matmul
operands are cast to x's dtype (bf16 on GPU training) with float32 accumulation; float32 inputs use
3xTF32 products (FP32_PRECISION). So the states entering the chunks (b, chunks, h, p, n), saved for
the backward, and the gradients w.r.t. the chunks' own states are stored in x's dtype, which is all
the chunk scan's products read of them (half the bytes in bf16); so are each head's parts of dB
and dC (rounded once, as the bf16 gradient they sum to is), summed over the heads in float32. The
state carried along the chunks, the final state and every sum stay float32.

Document boundaries (`seg`, see ssd.py): cs is then the cumulative log-decay restarting at each
boundary, formed by one small kernel (`_segment_cumsum_kernel`, forward and backward) as a segmented
scan over each chunk's tokens (a (chunk, heads) tile per program), like ssd.segment_cumsum but in
float32: each sum holds only its own segment's terms (the scan restarts at a segment's first token),
so one document's decays do not depend on the document before it; against the float64 sums it
differs by float32 rounding of a sum of at most Q same-sign terms, the precision of the plain cumsum
of the path without boundaries.
The kernels then mask by segment: the in-chunk decay
between two segments is exactly 0, only the chunk's last segment writes S_c, only the tokens of the
segment entering the chunk read H_c, and H_c passes through a chunk only when it holds no boundary.
Masked exponents are -inf before exp (never exp(...) * 0), so no inf * 0 appears. HAS_SEG=False
compiles the kernels without any of it.

Segment initial state (`segment_init` S0 (h, p, n), see ssd._ssd_chunked): a segment that starts
inside chunk c starts from S0 instead of zero. Its tokens add exp(cs_i) S0 C_i (chunk_scan, the
tokens not in the segment entering the chunk), and a chunk with a boundary passes on
exp(cs_end) S0 + S_c instead of S_c (the states kernel: the state a chunk decays is H_c when it
passes, S0 when it does not). Backward: dC and dcs of the first term in chunk_scan; dS0 is summed
by the states kernel over the chunks with a boundary (exp(cs_end) G_{c+1}, plus
sum_i exp(cs_i) dy_i C_i^T over the new segments' tokens), and dcs_end becomes
exp(cs_end) <G_{c+1}, H_c or S0> (chunk_scan). Chunks without a boundary skip all of it (a branch on
the chunk's segment ids). HAS_SINIT=False compiles the kernels without it.

Imports without CUDA or Triton; under TRITON_INTERPRET=1 the kernels run on CPU tensors (tests).
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F

# the reference path runs everywhere; this one needs Triton
from elephant.layers.triton_env import FLOAT_DTYPES
from elephant.layers.triton_env import HAS_TRITON as HAVE_TRITON
from elephant.layers.triton_env import tl, triton
from elephant.layers.triton_env import custom_op, register_autograd


def check_shapes(x, dt, A, B, C, D, initial_state, seg=None, segment_init=None) -> None:
    """The inputs of every SSD scan (see ssd.py's docstring for the shapes); here, not in ssd.py,
    so that this kernel file never imports the module that dispatches to it."""
    if x.dim() != 4:
        raise ValueError(f"ssd: x must be (batch, length, heads, head_dim), got shape {tuple(x.shape)}")
    b, l, h, p = x.shape
    if dt.shape != (b, l, h):
        raise ValueError(f"ssd: dt must be {(b, l, h)}, got {tuple(dt.shape)}")
    if A.shape != (h,):
        raise ValueError(f"ssd: A must be ({h},), got {tuple(A.shape)}")
    if B.dim() != 4 or B.shape[:2] != (b, l) or C.shape != B.shape or h % B.shape[2]:
        raise ValueError(f"ssd: B and C must be ({b}, {l}, groups, d_state) with groups dividing "
                         f"{h} heads, got {tuple(B.shape)} and {tuple(C.shape)}")
    if D is not None and D.shape != (h,):
        raise ValueError(f"ssd: D must be ({h},) or None, got {tuple(D.shape)}")
    n = B.shape[3]
    if initial_state is not None and initial_state.shape != (b, h, p, n):
        raise ValueError(f"ssd: initial_state must be {(b, h, p, n)} or None, "
                         f"got {tuple(initial_state.shape)}")
    if seg is not None and (seg.shape != (b, l) or seg.is_floating_point()):
        raise ValueError(f"ssd: seg must be ({b}, {l}) integer segment ids or None, got "
                         f"{tuple(seg.shape)} {seg.dtype}")
    if segment_init is not None:
        if seg is None:
            raise ValueError("ssd: segment_init is the state of segments after the first: it needs seg")
        if segment_init.shape != (h, p, n):
            raise ValueError(f"ssd: segment_init must be {(h, p, n)} (one state for every segment "
                             f"after the first), got {tuple(segment_init.shape)}")


def check_joint(joint, x, B) -> None:
    """joint (see ssd.ssd_scan) must be (b, l, h p + 2 g n) in x's dtype."""
    if joint is None:
        return
    b, l, h, p = x.shape
    shape = (b, l, h * p + 2 * B.shape[2] * B.shape[3])
    if tuple(joint.shape) != shape or joint.dtype != x.dtype:
        raise ValueError(f"ssd: joint must be {shape} in x's dtype {x.dtype} (the tensor whose "
                         f"column blocks [x | B | C] are x, B and C), got {tuple(joint.shape)} "
                         f"{joint.dtype}")


def supports(x: torch.Tensor, B: torch.Tensor, chunk_size: int) -> bool:
    """Whether these kernels handle this problem (else ssd_scan falls back to ssd_chunked)."""
    b, l, h, p = x.shape
    n = B.shape[-1]
    padded = b * (l + chunk_size) * h
    return (HAVE_TRITON and x.dtype in FLOAT_DTYPES
            and chunk_size in (16, 32, 64, 128) and p <= 128 and n <= 128
            # float32 tiles of chunk x 128 with chunk 128 overflow shared memory on H100 (seen:
            # 256 KiB asked, 227 KiB there); those shapes take the PyTorch path
            and not (x.dtype == torch.float32 and chunk_size * max(p, n) > 64 * 128)
            and max(padded * max(p, n), padded // chunk_size * p * n) < 2**31)  # 32-bit offsets


if HAVE_TRITON:

    @triton.jit
    def _dot(a, b, DT: tl.constexpr, PREC: tl.constexpr):
        """a @ b with operands cast to DT (x's dtype), accumulated in float32. PREC: the float32
        product's precision, "" for 16-bit operands (where it does not apply)."""
        if PREC == "":
            return tl.dot(a.to(DT), b.to(DT))
        else:
            return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)

    @triton.jit
    def _segments(seg_ptr, b, c, NC, Q: tl.constexpr):
        """Segment ids of chunk c's tokens (Q,), of its last token, and of the token before it
        (0 before chunk 0). seg is padded to NC * Q (the tail repeats the last id)."""
        base = seg_ptr + b * NC * Q + c * Q
        seg = tl.load(base + tl.arange(0, Q))
        seg_end = tl.load(base + Q - 1)
        seg_prev = tl.load(base - 1, mask=c > 0, other=0)
        return seg, seg_end, seg_prev

    @triton.jit
    def _segmented_add(f1, v1, f2, v2):
        """The segmented sum's combine: a flag starts a new sum at its element."""
        return f1 | f2, tl.where(f2 != 0, v2, v1 + v2)

    @triton.jit
    def _segment_cumsum_kernel(
        v_ptr, seg_ptr, out_ptr, L, H, NC,
        Q: tl.constexpr, BH: tl.constexpr, BACKWARD: tl.constexpr,
    ):
        """forward:  out[b, h, c, i] = sum_{j <= i, seg_j = seg_i} v[b, c*Q + j, h]   (v = dt A, (b, l, h))
        backward: out[b, c*Q + j, h] = sum_{i >= j, seg_i = seg_j} v[b, h, c, i]   (v = dLoss/dcs)
        over one chunk of one lane, every head at once (a (Q, heads) tile, read along the heads,
        (b, l, h)'s contiguous axis); seg padded to NC * Q. A segmented scan over the chunk's
        tokens; the backward scans the chunk in reverse (token Q-1-k at row k), where a segment
        starts at its last token."""
        c = tl.program_id(0)
        b = tl.program_id(1)
        k = tl.arange(0, Q)
        h = tl.arange(0, BH)
        hmask = h[None, :] < H
        if BACKWARD:
            i = Q - 1 - k                                   # row k holds token Q-1-k
            seg = tl.load(seg_ptr + b * NC * Q + c * Q + i)
            seg_next = tl.load(seg_ptr + b * NC * Q + c * Q + i + 1, mask=i < Q - 1, other=-1)
            first = seg != seg_next                         # the last token of its segment
            v = tl.load(v_ptr + ((b * H + h[None, :]) * NC + c) * Q + i[:, None], mask=hmask,
                        other=0.0)
        else:
            i = k
            seg = tl.load(seg_ptr + b * NC * Q + c * Q + i)
            seg_prev = tl.load(seg_ptr + b * NC * Q + c * Q + i - 1, mask=i > 0, other=-1)
            first = seg != seg_prev                         # the first token of its segment
            t = c * Q + i
            v = tl.load(v_ptr + (b * L + t[:, None]) * H + h[None, :],
                        mask=(t[:, None] < L) & hmask, other=0.0)
        flags = tl.broadcast_to(first.to(tl.int32)[:, None], (Q, BH))
        _, out = tl.associative_scan((flags, v), 0, _segmented_add)
        if BACKWARD:
            t = c * Q + i
            tl.store(out_ptr + (b * L + t[:, None]) * H + h[None, :], out,
                     mask=(t[:, None] < L) & hmask)
        else:
            tl.store(out_ptr + ((b * H + h[None, :]) * NC + c) * Q + i[:, None], out, mask=hmask)

    @triton.jit
    def _state_program(HEADS_PER_GROUP, P, N, Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
        """A state kernel's program: its rows-of-P block pb, lane b, head h and the head's B/C
        group g; the chunk's token offsets i (Q,); its rows p and columns n of the state, their
        mask and offsets within one lane's (h, p, n) state (BP, BN)."""
        pb = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        i = tl.arange(0, Q)
        p = pb * BP + tl.arange(0, BP)
        n = tl.arange(0, BN)
        pn_mask = (p[:, None] < P) & (n[None, :] < N)
        hpn = (h * P + p[:, None]) * N + n[None, :]
        return pb, b, h, h // HEADS_PER_GROUP, i, p, n, pn_mask, hpn

    @triton.jit
    def _chunk_operands(u_ptr, v_ptr, b, c, h, g, p, n, i, L, P, N, Q: tl.constexpr,
                        s_ub, s_ul, s_uh, s_up, s_vb, s_vl, s_vg, s_vn):
        """Chunk c's tokens t (Q,), which are in the sequence, and the state kernels' two operands
        there: u (Q, rows p) of head h in float32 (x or dy) and v (Q, N) of group g (B or C)."""
        t = c * Q + i
        tmask = t < L
        u = tl.load(u_ptr + b * s_ub + t[:, None] * s_ul + h * s_uh + p[None, :] * s_up,
                    mask=tmask[:, None] & (p[None, :] < P), other=0.0).to(tl.float32)
        v = tl.load(v_ptr + b * s_vb + t[:, None] * s_vl + g * s_vg + n[None, :] * s_vn,
                    mask=tmask[:, None] & (n[None, :] < N), other=0.0)
        return t, tmask, u, v

    @triton.jit
    def _states_fwd_kernel(
        x_ptr, dt_ptr, b_ptr, cs_ptr, seg_ptr, init_ptr, sinit_ptr, states_ptr, final_ptr,
        L, H, P, N, HEADS_PER_GROUP,
        s_xb, s_xl, s_xh, s_xp,
        s_db, s_dl, s_dh,
        s_bb, s_bl, s_bg, s_bn,
        NC: tl.constexpr, Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
        PREC: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEG: tl.constexpr, HAS_SINIT: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        """The state entering every chunk, H_c (b, c, h, p, n) in states' dtype (x's), and the
        final state in float32: one program per (rows of P, lane, head) walks the lane's chunks in
        order, holding H in float32 registers, and adds each chunk's own state
        S_c = sum_j exp(cs_end - cs_j) dt_j x_j B_j^T as it goes (never written: until 2026-11-25
        a chunk_state kernel wrote every S_c and a state pass read them back). With boundaries
        only the chunk's last segment writes S_c, and a chunk holding one passes on S_c plus its
        last segment's start decayed: exp(cs_end) S0 with HAS_SINIT, nothing without."""
        pb, b, h, g, i, p, n, pn_mask, hpn = _state_program(HEADS_PER_GROUP, P, N, Q, BP, BN)
        DT: tl.constexpr = x_ptr.dtype.element_ty
        if HAS_INIT:
            s = tl.load(init_ptr + b * H * P * N + hpn, mask=pn_mask, other=0.0).to(tl.float32)
        else:
            s = tl.zeros((BP, BN), dtype=tl.float32)
        if HAS_SINIT:
            s0 = tl.load(sinit_ptr + hpn, mask=pn_mask, other=0.0)
        for c in tl.range(0, NC, num_stages=STAGES):
            tl.store(states_ptr + (b * NC + c) * H * P * N + hpn, s.to(states_ptr.dtype.element_ty),
                     mask=pn_mask)
            t, tmask, u, v = _chunk_operands(x_ptr, b_ptr, b, c, h, g, p, n, i, L, P, N, Q,
                                             s_xb, s_xl, s_xh, s_xp, s_bb, s_bl, s_bg, s_bn)
            dt = tl.load(dt_ptr + b * s_db + t * s_dl + h * s_dh, mask=tmask, other=0.0).to(tl.float32)
            cs_base = cs_ptr + ((b * H + h) * NC + c) * Q
            cs = tl.load(cs_base + i)
            cs_end = tl.load(cs_base + Q - 1)
            decay = tl.exp(cs_end)
            if HAS_SEG:
                seg, seg_end, seg_prev = _segments(seg_ptr, b, c, NC, Q)
                w = tl.exp(tl.where(seg == seg_end, cs_end - cs, float("-inf"))) * dt
                own = _dot(tl.trans(u * w[:, None]), v, DT, PREC)                         # (BP, BN)
                passes = seg_end == seg_prev    # no boundary in the chunk
                if HAS_SINIT:
                    s = decay * tl.where(passes, s, s0) + own
                else:
                    s = tl.where(passes, decay, 0.0) * s + own
            else:
                w = tl.exp(cs_end - cs) * dt
                s = decay * s + _dot(tl.trans(u * w[:, None]), v, DT, PREC)
        tl.store(final_ptr + b * H * P * N + hpn, s, mask=pn_mask)

    @triton.jit
    def _states_bwd_kernel(
        dy_ptr, c_ptr, cs_ptr, seg_ptr, states_ptr, sinit_ptr, dfinal_ptr, dstates_ptr,
        dcs_end_ptr, dinit_ptr, dsinit_ptr,
        L, H, P, N, HEADS_PER_GROUP,
        s_yb, s_yl, s_yh, s_yp,
        s_cb, s_cl, s_cg, s_cn,
        NC: tl.constexpr, Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
        PREC: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEG: tl.constexpr, HAS_SINIT: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        """The gradient w.r.t. every chunk's own state, G_{c+1} into dstates (b, c, h, p, n), with
        G_C = dfinal and G_c = exp(cs_end) G_{c+1} + sum_i exp(cs_i) dy_i C_i^T (what chunk c's
        outputs ask of the state entering it), walked from the last chunk with G in registers;
        dinit = G_0. With boundaries G passes back only through chunks without one, only the
        tokens of the segment entering the chunk read that state, and with HAS_SINIT this lane's
        dLoss/dS0 (b, h, p, n) sums, over the chunks with a boundary, exp(cs_end) G_{c+1} and the
        new segments' tokens' sum_i exp(cs_i) dy_i C_i^T. dcs_end (b, h, c, P / BP): this program's
        part of dLoss/dcs_end through the state the chunk passes on, exp(cs_end) <G_{c+1}, H_c>
        (S0 in H_c's place in a chunk with a boundary; nothing there without S0), for the chunk
        scan's backward to add."""
        pb, b, h, g, i, p, n, pn_mask, hpn = _state_program(HEADS_PER_GROUP, P, N, Q, BP, BN)
        DT: tl.constexpr = dy_ptr.dtype.element_ty
        grad = tl.load(dfinal_ptr + b * H * P * N + hpn, mask=pn_mask, other=0.0)
        if HAS_SINIT:
            ds0 = tl.zeros((BP, BN), dtype=tl.float32)
            s0 = tl.load(sinit_ptr + hpn, mask=pn_mask, other=0.0)
        NBLK = tl.num_programs(0)
        for k in tl.range(0, NC, num_stages=STAGES):
            c = NC - 1 - k
            tl.store(dstates_ptr + (b * NC + c) * H * P * N + hpn,
                     grad.to(dstates_ptr.dtype.element_ty), mask=pn_mask)
            s_in = tl.load(states_ptr + (b * NC + c) * H * P * N + hpn, mask=pn_mask,
                           other=0.0).to(tl.float32)
            _, _, u, v = _chunk_operands(dy_ptr, c_ptr, b, c, h, g, p, n, i, L, P, N, Q,
                                         s_yb, s_yl, s_yh, s_yp, s_cb, s_cl, s_cg, s_cn)
            cs_base = cs_ptr + ((b * H + h) * NC + c) * Q
            cs = tl.load(cs_base + i)
            decay = tl.exp(tl.load(cs_base + Q - 1))
            end_ptr = dcs_end_ptr + ((b * H + h) * NC + c) * NBLK + pb
            # the state the chunk decays, cs_end's factor on <G_{c+1}, that state>, and the
            # factor G_{c+1} passes back to G_c with
            base, scale, through = s_in, decay, decay
            if HAS_SEG:
                seg, seg_end, seg_prev = _segments(seg_ptr, b, c, NC, Q)
                reads = tl.where(seg == seg_prev, cs, float("-inf"))  # the tokens reading H_c
                through = tl.where(seg_end == seg_prev, decay, 0.0)   # no boundary in the chunk
                if HAS_SINIT:
                    base = tl.where(seg_end == seg_prev, s_in, s0)
                    if seg_end != seg_prev:   # a segment starts in the chunk: S0's share
                        w_new = tl.exp(tl.where(seg != seg_prev, cs, float("-inf")))
                        ds0 += decay * grad + _dot(tl.trans(u * w_new[:, None]), v, DT, PREC)
                else:
                    scale = through
            else:
                reads = cs
            tl.store(end_ptr, tl.sum(tl.sum(grad * base, axis=1), axis=0) * scale)
            grad = _dot(tl.trans(u * tl.exp(reads)[:, None]), v, DT, PREC) + through * grad
        if HAS_INIT:
            tl.store(dinit_ptr + b * H * P * N + hpn, grad, mask=pn_mask)
        if HAS_SINIT:
            tl.store(dsinit_ptr + b * H * P * N + hpn, ds0, mask=pn_mask)

    @triton.jit
    def _chunk_scan_fwd_kernel(
        x_ptr, dt_ptr, b_ptr, c_ptr, cs_ptr, seg_ptr, states_ptr, sinit_ptr, d_ptr, y_ptr,
        L, H, NC, P, N, HEADS_PER_GROUP,
        s_xb, s_xl, s_xh, s_xp,
        s_db, s_dl, s_dh,
        s_bb, s_bl, s_bg, s_bn,
        s_cb, s_cl, s_cg, s_cn,
        Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
        HAS_D: tl.constexpr, PREC: tl.constexpr, HAS_SEG: tl.constexpr, HAS_SINIT: tl.constexpr,
    ):
        """y for one chunk: the in-chunk quadratic form, the incoming state's part (and S0's for the
        segments starting in the chunk), and D x."""
        c = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        g = h // HEADS_PER_GROUP
        DT: tl.constexpr = x_ptr.dtype.element_ty
        i = tl.arange(0, Q)
        p = tl.arange(0, BP)
        n = tl.arange(0, BN)
        t = c * Q + i
        tmask = t < L
        qp_mask = tmask[:, None] & (p[None, :] < P)
        qn_mask = tmask[:, None] & (n[None, :] < N)
        x = tl.load(x_ptr + b * s_xb + t[:, None] * s_xl + h * s_xh + p[None, :] * s_xp,
                    mask=qp_mask, other=0.0).to(tl.float32)                                  # (Q, P)
        dt = tl.load(dt_ptr + b * s_db + t * s_dl + h * s_dh, mask=tmask, other=0.0).to(tl.float32)
        Bm = tl.load(b_ptr + b * s_bb + t[:, None] * s_bl + g * s_bg + n[None, :] * s_bn,
                     mask=qn_mask, other=0.0)                                                # (Q, N)
        Cm = tl.load(c_ptr + b * s_cb + t[:, None] * s_cl + g * s_cg + n[None, :] * s_cn,
                     mask=qn_mask, other=0.0)                                                # (Q, N)
        cs = tl.load(cs_ptr + ((b * H + h) * NC + c) * Q + i)
        s_in = tl.load(states_ptr + (((b * NC + c) * H + h) * P + p[:, None]) * N + n[None, :],
                       mask=(p[:, None] < P) & (n[None, :] < N), other=0.0)                  # (P, N)

        causal = i[:, None] >= i[None, :]
        if HAS_SEG:
            seg, seg_end, seg_prev = _segments(seg_ptr, b, c, NC, Q)
            causal = causal & (seg[:, None] == seg[None, :])
            e_cs = tl.exp(tl.where(seg == seg_prev, cs, float("-inf")))
        else:
            e_cs = tl.exp(cs)
        decay = tl.exp(tl.where(causal, cs[:, None] - cs[None, :], float("-inf")))           # (Q, Q)
        M = _dot(Cm, tl.trans(Bm), DT, PREC) * decay
        y = _dot(M, x * dt[:, None], DT, PREC)
        y += _dot(Cm, tl.trans(s_in), DT, PREC) * e_cs[:, None]
        if HAS_SINIT:
            if seg_end != seg_prev:  # segments start in this chunk: their tokens read S0
                s0 = tl.load(sinit_ptr + (h * P + p[:, None]) * N + n[None, :],
                             mask=(p[:, None] < P) & (n[None, :] < N), other=0.0)            # (P, N)
                e_new = tl.exp(tl.where(seg != seg_prev, cs, float("-inf")))
                y += _dot(Cm, tl.trans(s0), DT, PREC) * e_new[:, None]
        if HAS_D:
            y += tl.load(d_ptr + h).to(tl.float32) * x
        tl.store(y_ptr + ((b * L + t[:, None]) * H + h) * P + p[None, :], y, mask=qp_mask)

    @triton.jit
    def _chunk_scan_bwd_kernel(
        x_ptr, dt_ptr, b_ptr, c_ptr, cs_ptr, seg_ptr, states_ptr, sinit_ptr, d_ptr, dy_ptr, dstates_ptr,
        dcs_end_ptr, dx_ptr, ddt_ptr, dbc_ptr, dcs_ptr, dd_ptr,
        L, H, NC, P, N, HEADS_PER_GROUP, NBLK,
        s_xb, s_xl, s_xh, s_xp,
        s_db, s_dl, s_dh,
        s_bb, s_bl, s_bg, s_bn,
        s_cb, s_cl, s_cg, s_cn,
        s_yb, s_yl, s_yh, s_yp,
        s_gb, s_gl, s_gh, s_gp,
        Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, BBLK: tl.constexpr,
        HAS_D: tl.constexpr, PREC: tl.constexpr, HAS_SEG: tl.constexpr, HAS_SINIT: tl.constexpr,
    ):
        """All gradients of one chunk given dy and dS_c (the gradient w.r.t. the chunk's own state).
        (dS0 is formed by the backward state kernel; here S0's term adds to dC and dcs, and the
        state kernel's parts of dcs_end, NBLK of them, to dcs.)
        dB and dC are written per head into one tensor (b, l, h, 2, n) in x's dtype (dB at [..., 0, :],
        dC at [..., 1, :]); dcs per (b, h, c, Q); dD per (b, c, h); dx at its strides (s_g*: the
        x columns of the joint gradient, or a tensor of its own)."""
        c = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        g = h // HEADS_PER_GROUP
        DT: tl.constexpr = x_ptr.dtype.element_ty
        i = tl.arange(0, Q)
        p = tl.arange(0, BP)
        n = tl.arange(0, BN)
        t = c * Q + i
        tmask = t < L
        qp_mask = tmask[:, None] & (p[None, :] < P)
        qn_mask = tmask[:, None] & (n[None, :] < N)
        pn_mask = (p[:, None] < P) & (n[None, :] < N)
        # x and dy stay in their dtype (registers are the limit here); products upcast to float32
        x = tl.load(x_ptr + b * s_xb + t[:, None] * s_xl + h * s_xh + p[None, :] * s_xp,
                    mask=qp_mask, other=0.0)                                                 # (Q, P)
        dy = tl.load(dy_ptr + b * s_yb + t[:, None] * s_yl + h * s_yh + p[None, :] * s_yp,
                     mask=qp_mask, other=0.0)                                                # (Q, P)
        dt = tl.load(dt_ptr + b * s_db + t * s_dl + h * s_dh, mask=tmask, other=0.0).to(tl.float32)
        Bm = tl.load(b_ptr + b * s_bb + t[:, None] * s_bl + g * s_bg + n[None, :] * s_bn,
                     mask=qn_mask, other=0.0)                                                # (Q, N)
        Cm = tl.load(c_ptr + b * s_cb + t[:, None] * s_cl + g * s_cg + n[None, :] * s_cn,
                     mask=qn_mask, other=0.0)                                                # (Q, N)
        cs_base = cs_ptr + ((b * H + h) * NC + c) * Q
        cs = tl.load(cs_base + i)
        cs_end = tl.load(cs_base + Q - 1)
        pn_off = (((b * NC + c) * H + h) * P + p[:, None]) * N + n[None, :]
        # xdt as the products take it (cast to DT): a 16-bit tile in registers, not a float32 one
        xdt = (x.to(tl.float32) * dt[:, None]).to(DT)
        causal = i[:, None] >= i[None, :]
        if HAS_SEG:
            seg, seg_end, seg_prev = _segments(seg_ptr, b, c, NC, Q)
            causal = causal & (seg[:, None] == seg[None, :])
            w = tl.exp(tl.where(seg == seg_end, cs_end - cs, float("-inf")))
            e_cs = tl.exp(tl.where(seg == seg_prev, cs, float("-inf")))
        else:
            w = tl.exp(cs_end - cs)
            e_cs = tl.exp(cs)
        # The order below keeps few float32 tiles alive at once (registers are the limit of this
        # kernel): the Q x Q products first, then each gradient stored as soon as it is whole,
        # dx's float32 tile last. H100, 2026-11-26, the recipe's shape (kernels.py scan-launch,
        # `registers`): the earlier order (the state's gradients first, dx's tile alive throughout)
        # spilled 88 registers at 4 warps and this one none; the scan's backward ran 317 -> 276
        # us without boundaries and 371 -> 322 with them.
        # in-chunk part: y_i += sum_{j <= i} M_ij xdt_j with M_ij = (C_i . B_j) exp(cs_i - cs_j);
        # dM = dy xdt^T, dK = dM * decay (the gradient w.r.t. C B^T), and dM * M = dK * (C B^T)
        decay = tl.exp(tl.where(causal, cs[:, None] - cs[None, :], float("-inf")))           # (Q, Q)
        dK = _dot(dy, tl.trans(xdt), DT, PREC) * decay                                     # (Q, Q)
        CB = _dot(Cm, tl.trans(Bm), DT, PREC)                                               # (Q, Q)
        M = (CB * decay).to(DT)
        R = dK * CB
        dcs = tl.sum(R, axis=1) - tl.sum(R, axis=0)
        dK = dK.to(DT)

        # dB: the chunk's own state S_c = sum_j exp(cs_end - cs_j) xdt_j B_j^T, with dS_c given
        ds = tl.load(dstates_ptr + pn_off, mask=pn_mask, other=0.0)                          # (P, N)
        dB = _dot(xdt, ds, DT, PREC) * w[:, None] + _dot(tl.trans(dK), Cm, DT, PREC)      # (Q, N)
        qn_off = ((b * L + t[:, None]) * H + h) * (2 * N) + n[None, :]
        tl.store(dbc_ptr + qn_off, dB.to(dbc_ptr.dtype.element_ty), mask=qn_mask)

        # dC: the incoming state's part y_i += exp(cs_i) H_c C_i, and the in-chunk part
        s_in = tl.load(states_ptr + pn_off, mask=pn_mask, other=0.0)                         # (P, N)
        dcs += tl.sum(dy.to(tl.float32) * _dot(Cm, tl.trans(s_in), DT, PREC), axis=1) * e_cs
        dC = _dot(dy, s_in, DT, PREC) * e_cs[:, None] + _dot(dK, Bm, DT, PREC)            # (Q, N)
        if HAS_SINIT:
            if seg_end != seg_prev:  # the segments starting in this chunk: y_i += exp(cs_i) S0 C_i
                s0 = tl.load(sinit_ptr + (h * P + p[:, None]) * N + n[None, :], mask=pn_mask, other=0.0)
                e_new = tl.exp(tl.where(seg != seg_prev, cs, float("-inf")))
                dcs += tl.sum(dy.to(tl.float32) * _dot(Cm, tl.trans(s0), DT, PREC), axis=1) * e_new
                dC += _dot(dy, s0, DT, PREC) * e_new[:, None]
        tl.store(dbc_ptr + qn_off + N, dC.to(dbc_ptr.dtype.element_ty), mask=qn_mask)
        # the state passed on through its decay: the state kernel's parts of dLoss/dcs_end
        blk = tl.arange(0, BBLK)
        end = tl.sum(tl.load(dcs_end_ptr + ((b * H + h) * NC + c) * NBLK + blk, mask=blk < NBLK,
                             other=0.0))
        dcs += tl.where(i == Q - 1, end, 0.0)

        # dx: through S_c and through the in-chunk part
        BdS = _dot(Bm, tl.trans(ds), DT, PREC)                                              # (Q, P)
        dw = tl.sum(x.to(tl.float32) * BdS, axis=1) * dt * w
        dcs += tl.where(i == Q - 1, tl.sum(dw, axis=0), 0.0) - dw
        dxdt = BdS * w[:, None] + _dot(tl.trans(M), dy, DT, PREC)                         # (Q, P)

        dx = dxdt * dt[:, None]
        if HAS_D:
            dyf = dy.to(tl.float32)
            xf = x.to(tl.float32)
            dx += tl.load(d_ptr + h).to(tl.float32) * dyf
            tl.store(dd_ptr + (b * NC + c) * H + h, tl.sum(tl.sum(dyf * xf, axis=1), axis=0))
        tl.store(dx_ptr + b * s_gb + t[:, None] * s_gl + h * s_gh + p[None, :] * s_gp,
                 dx.to(dx_ptr.dtype.element_ty), mask=qp_mask)
        tl.store(ddt_ptr + (b * L + t) * H + h, tl.sum(dxdt * x.to(tl.float32), axis=1), mask=tmask)
        tl.store(dcs_ptr + ((b * H + h) * NC + c) * Q + i, dcs)

    @triton.jit
    def _group_sum_kernel(src_ptr, out_ptr, T, H, W, s_ot, HEADS_PER_GROUP: tl.constexpr,
                          BT: tl.constexpr, BW: tl.constexpr, JOINT: tl.constexpr):
        """out (T, G, W) float32 = the sum of src (T, H, W) over each group's heads
        (h // HEADS_PER_GROUP = g), accumulated in float32 in head order. JOINT: W = 2 n holds
        [dB | dC], and the sums go to the rows (stride s_ot) of the [B (G, n) | C (G, n)] columns
        that out_ptr starts at, in out's dtype."""
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        g = tl.program_id(1)
        w = tl.arange(0, BW)
        m = (t < T)[:, None] & (w < W)[None, :]
        row = t[:, None].to(tl.int64) * H
        acc = tl.zeros((BT, BW), dtype=tl.float32)
        for j in tl.static_range(HEADS_PER_GROUP):
            acc += tl.load(src_ptr + (row + g * HEADS_PER_GROUP + j) * W + w[None, :], mask=m,
                           other=0.0).to(tl.float32)
        G = H // HEADS_PER_GROUP
        if JOINT:
            n = W // 2
            col = (w // n) * (G * n) + g * n + w % n                 # B's group g, then C's
            tl.store(out_ptr + t[:, None].to(tl.int64) * s_ot + col[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m)
        else:
            tl.store(out_ptr + (t[:, None].to(tl.int64) * G + g) * W + w[None, :], acc, mask=m)


def group_sum(src: torch.Tensor, groups: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """src (..., H, W) contiguous -> (..., groups, W) float32: the sum over each group's H / groups
    heads (the scan backward's dB and dC per head, one launch for both).

    With `out` (T, 2 groups n), W = 2 n: the sums are written, in out's dtype, into its columns
    [dB of each group | dC of each group] (the B and C blocks of the scan's joint gradient; rows at
    any stride, columns contiguous), and out is returned."""
    *lead, H, W = src.shape
    T = src.numel() // (H * W)
    joint = out is not None
    if joint and (out.shape != (T, groups * W) or out.stride(1) != 1):
        raise ValueError(f"group_sum: out must be ({T}, {groups * W}) with contiguous columns, got "
                         f"{tuple(out.shape)} strides {out.stride()}")
    if not joint:
        out = torch.empty(*lead, groups, W, device=src.device, dtype=torch.float32)
    BW = triton.next_power_of_2(W)
    # 8 tokens and 8 warps a program at the recipe's width (2 x 64): on an H100 28.8 us against 32.8
    # for 32 tokens and 4 warps (benchmarks/kernels.py group-sum; ~2.4 TB/s)
    BT = max(1, 1024 // BW)
    _group_sum_kernel[(triton.cdiv(T, BT), groups)](
        src, out, T, H, W, out.stride(0) if joint else 0, H // groups, BT=BT, BW=BW, JOINT=joint,
        num_warps=8)
    return out


# float32 inputs: three TF32 tensor-core products per product (about float32 accuracy at a fraction of
# the cost of "ieee", which runs on the CUDA cores and spills registers); "ieee" and "tf32" also work.
FP32_PRECISION = "tf32x3"


def _precision(x: torch.Tensor) -> str:
    return FP32_PRECISION if x.dtype == torch.float32 else ""


def _blocks(p: int, n: int) -> tuple[int, int]:
    return max(16, triton.next_power_of_2(p)), max(16, triton.next_power_of_2(n))


# (rows of P per program, warps, pipeline stages) of the two state kernels, forward and backward;
# set from benchmarks/kernels.py state-pass
STATES_LAUNCH = {"fwd": (32, 2, 2), "bwd": (32, 4, 2)}


def _states_launch(p: int, backward: bool) -> tuple[int, int, int]:
    """(rows of P per program, warps, stages) of a state kernel. Each program walks one lane's
    chunks in order for its rows of one head's (P, N) state, so the grid is (P / rows) x lanes x
    heads: fewer rows, more programs in flight."""
    rows, warps, stages = STATES_LAUNCH["bwd" if backward else "fwd"]
    return max(16, min(rows, triton.next_power_of_2(p))), warps, stages


def _scan_launch(backward: bool, has_seg: bool, big: bool) -> dict:
    """Launch options of a chunk-scan kernel (one program per chunk and head). Measured by
    benchmarks/kernels.py scan-launch on an H100 at the recipe's shape (bf16, chunks of 64, P = N =
    64), the whole forward and backward of the scan timed: the backward ran 608 us at 4 warps
    against 711 at 8 (the launch before), with segments 725 at 4 warps and one stage against 905;
    the forward is fastest at 4, and 2 warps is several times slower. Tiles of 128 take 8 warps."""
    if big:
        return {"num_warps": 8}
    if backward and has_seg:
        return {"num_warps": 4, "num_stages": 1}
    return {"num_warps": 4}


def _fwd(x, dt, cs, seg, B, C, D, init, sinit, Q, launch=None, state_launch=None):
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    nc = cs.shape[2]
    BP, BN = _blocks(p, n)
    prec = _precision(x)
    has_seg = seg is not None
    seg = seg if has_seg else cs  # a placeholder pointer when there are no boundaries
    has_sinit = sinit is not None
    states = torch.empty(b, nc, h, p, n, device=x.device, dtype=x.dtype)
    final = torch.empty(b, h, p, n, device=x.device, dtype=torch.float32)
    rows, warps, stages = state_launch or _states_launch(p, backward=False)
    _states_fwd_kernel[(triton.cdiv(p, rows), b, h)](
        x, dt, B, cs, seg, init if init is not None else final, sinit if has_sinit else final,
        states, final, l, h, p, n, h // g,
        *x.stride(), *dt.stride(), *B.stride(),
        NC=nc, Q=Q, BP=rows, BN=BN, PREC=prec, HAS_INIT=init is not None, HAS_SEG=has_seg,
        HAS_SINIT=has_sinit, STAGES=stages, num_warps=warps)
    y = torch.empty(b, l, h, p, device=x.device, dtype=x.dtype)
    _chunk_scan_fwd_kernel[(nc, b, h)](
        x, dt, B, C, cs, seg, states, sinit if has_sinit else states, D if D is not None else x, y,
        l, h, nc, p, n, h // g,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(),
        Q=Q, BP=BP, BN=BN, HAS_D=D is not None, PREC=prec, HAS_SEG=has_seg, HAS_SINIT=has_sinit,
        **(launch or _scan_launch(False, has_seg, max(Q, BP, BN) > 64)))
    return y, final, states


def _bwd(x, dt, cs, seg, B, C, D, init, sinit, states, dy, dfinal, Q, launch=None,
         state_launch=None, summed=True, joint=False):
    """The scan's gradients (dx, ddt, dcs, dBC, dD, dinit, dsinit). summed=False: dD per lane and
    chunk (b, chunks, h) and dsinit per lane (b, h, p, n), for the caller to sum (the custom op
    leaves those sums to its autograd formula, which a compiled graph fuses).

    joint: the gradients of x, B and C as one tensor (b, l, h p + 2 g n) [dx | dB | dC] in x's
    dtype, written by the kernels at its columns, in dx's place; dBC is then None."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    nc = cs.shape[2]
    BP, BN = _blocks(p, n)
    prec = _precision(x)
    f32 = dict(device=x.device, dtype=torch.float32)
    has_seg = seg is not None
    seg = seg if has_seg else cs
    has_sinit = sinit is not None
    # the gradient w.r.t. each chunk's own state (= w.r.t. the state leaving it)
    dstates = torch.empty(b, nc, h, p, n, device=x.device, dtype=x.dtype)
    dinit = torch.empty(b, h, p, n, **f32) if init is not None else None
    dsinit = torch.empty(b, h, p, n, **f32) if has_sinit else None  # per lane, summed below
    rows, warps, stages = state_launch or _states_launch(p, backward=True)
    nblk = triton.cdiv(p, rows)
    dcs_end = torch.empty(b, h, nc, nblk, **f32)  # parts of dLoss/dcs_end, per program of rows
    _states_bwd_kernel[(nblk, b, h)](
        dy, C, cs, seg, states, sinit if has_sinit else dstates, dfinal.float().contiguous(),
        dstates, dcs_end, dinit if dinit is not None else dstates, dsinit if has_sinit else dstates,
        l, h, p, n, h // g, *dy.stride(), *C.stride(),
        NC=nc, Q=Q, BP=rows, BN=BN, PREC=prec, HAS_INIT=init is not None, HAS_SEG=has_seg,
        HAS_SINIT=has_sinit, STAGES=stages, num_warps=warps)
    if joint:
        dxbc = torch.empty(b, l, h * p + 2 * g * n, device=x.device, dtype=x.dtype)
        dx = dxbc[..., :h * p].view(b, l, h, p)
    else:
        dx = torch.empty(b, l, h, p, device=x.device, dtype=x.dtype)
    ddt = torch.empty(b, l, h, **f32)
    # dB and dC per head in one tensor, in x's dtype (bf16 in training: half the bytes of the
    # largest outputs), summed over the group's heads in float32 below by one launch for both
    dBC = torch.empty(b, l, h, 2, n, device=x.device, dtype=x.dtype)
    dcs = torch.empty(b, h, nc, Q, **f32)
    dD = torch.empty(b, nc, h, **f32) if D is not None else None
    _chunk_scan_bwd_kernel[(nc, b, h)](
        x, dt, B, C, cs, seg, states, sinit if has_sinit else states, D if D is not None else x, dy,
        dstates, dcs_end, dx, ddt, dBC, dcs, dD if dD is not None else ddt,
        l, h, nc, p, n, h // g, nblk,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *dy.stride(), *dx.stride(),
        Q=Q, BP=BP, BN=BN, BBLK=triton.next_power_of_2(nblk), HAS_D=D is not None, PREC=prec,
        HAS_SEG=has_seg, HAS_SINIT=has_sinit,
        **(launch or _scan_launch(True, has_seg, max(Q, BP, BN) > 64)))
    if joint:
        group_sum(dBC.view(b, l, h, 2 * n), g, out=dxbc.view(b * l, -1)[:, h * p:])
        dx, dBC = dxbc, None
    else:
        dBC = group_sum(dBC.view(b, l, h, 2 * n), g).view(b, l, g, 2, n)
    if summed:
        dD, dsinit = _sum_parts(dD, dsinit)
    return dx, ddt, dcs, dBC, dD, dinit, dsinit


def _sum_parts(dD, dsinit):
    """dD per lane and chunk (b, chunks, h) -> (h,); dsinit per lane (b, h, p, n) -> (h, p, n)
    (None stays None)."""
    return (dD.sum((0, 1)) if dD is not None else None,
            dsinit.sum(0) if dsinit is not None else None)


# ------------------------------------------------------------------------------- custom ops
# The kernels are wrapped as torch.library custom ops (forward and backward each one op, with
# shape-only fake implementations), so torch.compile keeps a Mamba layer in one graph around the
# scan instead of breaking it there. Optional outputs of the backward come back as empty tensors
# (a custom op returns tensors only) and become None in the autograd formula.

def _none_if_empty(t: torch.Tensor):
    return None if t.numel() == 0 else t


@custom_op("elephant::segment_cumsum", mutates_args=())
def _segment_cumsum_op(dA: torch.Tensor, segp: torch.Tensor, Q: int) -> torch.Tensor:
    """(dA (b, l, h) float32, padded seg (b, chunks * Q) int32) -> cs (b, h, chunks, Q): the
    in-chunk cumulative log-decay restarting at each boundary (the padded tail adds nothing)."""
    b, l, h = dA.shape
    nc = segp.shape[1] // Q
    cs = torch.empty(b, h, nc, Q, device=dA.device, dtype=torch.float32)
    with _on_device(dA):
        _segment_cumsum_kernel[(nc, b)](dA.contiguous(), segp.contiguous(), cs, l, h, nc, Q=Q,
                                        BH=triton.next_power_of_2(h), BACKWARD=False, num_warps=4)
    return cs


@_segment_cumsum_op.register_fake
def _(dA, segp, Q):
    b, l, h = dA.shape
    return dA.new_empty(b, h, segp.shape[1] // Q, Q, dtype=torch.float32)


@custom_op("elephant::segment_cumsum_backward", mutates_args=())
def _segment_cumsum_bwd_op(dcs: torch.Tensor, segp: torch.Tensor, l: int, Q: int) -> torch.Tensor:
    b, h, nc, _ = dcs.shape
    ddA = torch.empty(b, l, h, device=dcs.device, dtype=torch.float32)
    with _on_device(dcs):
        _segment_cumsum_kernel[(nc, b)](dcs.contiguous(), segp.contiguous(), ddA, l, h, nc, Q=Q,
                                        BH=triton.next_power_of_2(h), BACKWARD=True, num_warps=4)
    return ddA


@_segment_cumsum_bwd_op.register_fake
def _(dcs, segp, l, Q):
    return dcs.new_empty(dcs.shape[0], l, dcs.shape[1], dtype=torch.float32)


def _segment_cumsum_setup(ctx, inputs, output):
    dA, segp, Q = inputs
    ctx.save_for_backward(segp)
    ctx.l, ctx.Q = dA.shape[1], Q


def _segment_cumsum_grad(ctx, dcs):
    (segp,) = ctx.saved_tensors
    return _segment_cumsum_bwd_op(dcs, segp, ctx.l, ctx.Q), None, None


register_autograd(_segment_cumsum_op, _segment_cumsum_grad,
                  setup_context=_segment_cumsum_setup)


def _on_device(x: torch.Tensor):
    """Triton launches on the current CUDA device: make it x's (several GPUs per process)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _contiguous(t):
    return t.contiguous() if t is not None else None


@custom_op("elephant::ssd", mutates_args=())
def _ssd_op(x: torch.Tensor, dt: torch.Tensor, cs: torch.Tensor, seg: Optional[torch.Tensor],
            B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor], init: Optional[torch.Tensor],
            sinit: Optional[torch.Tensor], Q: int, xbc: Optional[torch.Tensor] = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, dt, cs, seg, B, C, D, init, sinit) -> (y, final state, the states entering each chunk
    (saved for the backward)). seg: None, or the padded segment ids (b, chunks * Q) int32; sinit:
    None, or the segment initial state (h, p, n) in float32 (needs seg). xbc: None, or the tensor
    whose column blocks x, B and C are (see `ssd_triton`'s `joint`): not read here, it is what
    their gradient goes to."""
    with _on_device(x):
        return _fwd(x, dt, cs.contiguous(), _contiguous(seg), B, C, D, _contiguous(init),
                    _contiguous(sinit), Q)


@_ssd_op.register_fake
def _(x, dt, cs, seg, B, C, D, init, sinit, Q, xbc=None):
    b, l, h, p = x.shape
    n, nc = B.shape[3], cs.shape[2]
    return (x.new_empty(b, l, h, p), x.new_empty(b, h, p, n, dtype=torch.float32),
            x.new_empty(b, nc, h, p, n))


@custom_op("elephant::ssd_backward", mutates_args=())
def _ssd_bwd_op(x: torch.Tensor, dt: torch.Tensor, cs: torch.Tensor, seg: Optional[torch.Tensor],
                B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor], init: Optional[torch.Tensor],
                sinit: Optional[torch.Tensor], states: torch.Tensor, dy: torch.Tensor,
                dfinal: torch.Tensor, Q: int, joint: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor]:
    """The gradients (dx, ddt, dcs, dBC, dD, dinit, dsinit), dBC (b, l, g, 2, n) holding dB at
    [..., 0, :] and dC at [..., 1, :]; dD per lane and chunk (b, chunks, h) and dsinit per lane
    (b, h, p, n), summed by the autograd formula (traced, so a compiled graph fuses the sums
    instead of launching them from inside this op); the last three are empty when D, init or
    sinit is None. joint: [dx | dB | dC] as one (b, l, h p + 2 g n) tensor in dx's place, and dBC
    empty."""
    with _on_device(x):
        grads = _bwd(x, dt, cs.contiguous(), _contiguous(seg), B, C, D, _contiguous(init),
                     _contiguous(sinit), states.contiguous(), dy, dfinal, Q, summed=False,
                     joint=joint)
    return tuple(g if g is not None else x.new_empty(0, dtype=torch.float32) for g in grads)


@_ssd_bwd_op.register_fake
def _(x, dt, cs, seg, B, C, D, init, sinit, states, dy, dfinal, Q, joint=False):
    b, l, h, p = x.shape
    g, n, nc = B.shape[2], B.shape[3], cs.shape[2]

    def f32(*shape):
        return x.new_empty(*shape, dtype=torch.float32)
    return (x.new_empty(b, l, h * p + 2 * g * n) if joint else x.new_empty(b, l, h, p),
            f32(b, l, h), f32(b, h, nc, Q), f32(0) if joint else f32(b, l, g, 2, n),
            f32(b, nc, h) if D is not None else f32(0),
            f32(b, h, p, n) if init is not None else f32(0),
            f32(b, h, p, n) if sinit is not None else f32(0))


def _ssd_setup(ctx, inputs, output):
    x, dt, cs, seg, B, C, D, init, sinit, Q, xbc = inputs
    ctx.save_for_backward(x, dt, cs, seg, B, C, D, init, sinit, output[2])
    ctx.Q = Q
    ctx.joint_dtype = None if xbc is None else xbc.dtype


def _ssd_grad(ctx, dy, dfinal, dstates):
    x, dt, cs, seg, B, C, D, init, sinit, states = ctx.saved_tensors
    b, l, h, p = x.shape
    if dy is None:
        dy = torch.zeros_like(x)
    if dfinal is None:
        dfinal = x.new_zeros(b, h, p, B.shape[3], dtype=torch.float32)
    joint = ctx.joint_dtype is not None
    dx, ddt, dcs, dBC, dD, dinit, dsinit = _ssd_bwd_op(
        x, dt, cs, seg, B, C, D, init, sinit, states, dy, dfinal.float().contiguous(), ctx.Q, joint)
    dD, dinit, dsinit = (_none_if_empty(t) for t in (dD, dinit, dsinit))
    dD, dsinit = _sum_parts(dD, dsinit)
    dD = dD.to(D.dtype) if dD is not None else None
    if joint:   # x's, B's and C's gradients as xbc's one (the three views get none)
        return (None, ddt.to(dt.dtype), dcs, None, None, None, dD, dinit, dsinit, None,
                dx.to(ctx.joint_dtype))
    return (dx, ddt.to(dt.dtype), dcs, None, dBC[..., 0, :].to(B.dtype), dBC[..., 1, :].to(C.dtype),
            dD, dinit, dsinit, None, None)


register_autograd(_ssd_op, _ssd_grad, setup_context=_ssd_setup)


def decay_cumsum(dt, A, seg, Q: int):
    """(cs, segp): the in-chunk cumulative log-decay (b, h, chunks, Q) in float32 of dt (b, l, h)
    and A (h,), and the segment ids padded to whole chunks (int32), None without seg. The padded
    tail has dt = 0: no decay, no write. With seg the sum restarts at each boundary."""
    b, l, h = dt.shape
    nc = max(1, math.ceil(l / Q))
    if seg is None:
        dA = F.pad(dt.float() * A.float(), (0, 0, 0, nc * Q - l)).view(b, nc, Q, h)
        return dA.cumsum(2).permute(0, 3, 1, 2).contiguous(), None
    segp = padded_segments(seg, Q)
    return _segment_cumsum_op((dt.float() * A.float()).contiguous(), segp, Q), segp


def padded_segments(seg, Q: int):
    """The segment ids (b, l) as the kernels take them: padded with the last one to whole chunks
    of Q, int32."""
    b, l = seg.shape
    nc = max(1, math.ceil(l / Q))
    return torch.cat([seg, seg[:, -1:].expand(b, nc * Q - l)], dim=1).to(torch.int32).contiguous()


def decay_cumsum_backward(dcs, segp, l: int):
    """The gradient of `decay_cumsum`'s dt * A (b, l, h) float32 from dcs (b, h, chunks, Q): the
    in-chunk sums from the end (restarting at each boundary with segp)."""
    b, h, nc, Q = dcs.shape
    if segp is None:
        rev = dcs.flip(-1).cumsum(-1).flip(-1)                        # sum over s >= t in the chunk
        return rev.permute(0, 2, 3, 1).reshape(b, nc * Q, h)[:, :l]
    return _segment_cumsum_bwd_op(dcs, segp, l, Q)


def ssd_triton(x, dt, A, B, C, D=None, initial_state=None, chunk_size: int = 64, seg=None,
               segment_init=None, joint=None):
    """The chunked SSD scan through the Triton kernels; same contract as `ssd.ssd_chunked` (y in x's
    dtype, final state in float32), for float32 / bfloat16 / float16 inputs.

    joint: None, or xbc (b, l, h p + 2 g n) whose column blocks [x | B | C] are x, B and C (the
    Mamba block's activated conv output, split: see `ssd.ssd_scan`). The scan then reads x, B and
    C as those blocks of it, and their gradients come back as xbc's one gradient, written by the
    kernels at its columns, instead of three tensors that autograd would concatenate (a pass over
    them all)."""
    if not HAVE_TRITON:
        raise RuntimeError("ssd_triton: Triton is not installed; use ssd_chunked (ELEPHANT_SSD=ref)")
    check_shapes(x, dt, A, B, C, D, initial_state, seg, segment_init)
    check_joint(joint, x, B)
    if joint is not None:   # x, B and C read as its blocks; the op returns their gradient as its one
        b, l, h, p = x.shape
        g, n = B.shape[2], B.shape[3]
        xs, Bs, Cs = joint.split([h * p, g * n, g * n], dim=-1)
        x, B, C = xs.view(b, l, h, p), Bs.view(b, l, g, n), Cs.view(b, l, g, n)
    if not supports(x, B, chunk_size):
        raise ValueError(f"ssd_triton: needs float32/bfloat16/float16 x, chunk_size 16, 32, 64 or 128, "
                         f"head_dim and d_state <= 128, and tensors under 2**31 elements (split the "
                         f"batch); got {x.dtype}, chunk_size={chunk_size}, x {tuple(x.shape)}, "
                         f"d_state={B.shape[-1]}")
    Q = chunk_size
    cs, segp = decay_cumsum(dt, A, seg, Q)
    init = initial_state.float().contiguous() if initial_state is not None else None
    sinit = segment_init.float().contiguous() if segment_init is not None else None
    y, final, _ = _ssd_op(x, dt, cs, segp, B, C, D, init, sinit, Q, joint)
    return y, final
