"""The Mamba-2 scan (state-space duality, SSD) with an initial state in and the final state out.

Per head, with a state s of shape (P, N) and a scalar decay per token:

    s_t = exp(dt_t * A) * s_{t-1} + dt_t * x_t B_t^T        y_t = s_t C_t + D * x_t

Three implementations share one signature
`f(x, dt, A, B, C, D=None, initial_state=None[, chunk_size], seg=None, segment_init=None)
-> (y, final_state)`:

- `ssd_recurrent_ref`: token by token; slow, obviously right: the ground truth of the tests.
- `ssd_chunked`: the chunked SSD algorithm in PyTorch (Dao & Gu 2024, https://arxiv.org/abs/2405.21060,
  section 6): a quadratic "attention-like" product inside each block of `chunk_size` tokens, a state
  per block, and a short recurrence over block states. Differentiable, runs everywhere; the reference
  that the Triton kernels are held equal to.
- `ssd_triton` (in ssd_triton.py): the same algorithm as Triton kernels with a hand-written backward.

`ssd_scan` picks one: the Triton kernels for CUDA tensors when Triton imports, otherwise
`ssd_chunked`. `ELEPHANT_SSD=ref|triton|auto` in the environment (read at import) or `set_backend()`
forces a path, for tests and benchmarks.

Document boundaries (packed sequences, like mamba-ssm's `seq_idx`): `seg` (b, l) int, nondecreasing
along l, gives each token a segment id; where it changes the state restarts from zero: the decay
across a boundary is exactly 0 and no state passes from one segment's chunks to the next. The initial
state belongs to segment 0 (a row whose first token has seg > 0 ignores it), the final state is the
last segment's. `seg=None` is one segment (no boundary). `segment_init` (h, p, n), given with `seg`,
is the state every segment after the first starts from instead of zero (the model's initial-memory
prefix); the scans take it in their chunk-to-chunk pass and their state -> output term (see
`_ssd_chunked`). `add_segment_init` adds the same to a zero-restarting scan's result, outside the
scan: the straightforward form, kept as the reference the fused one is held equal to.

Shapes: x (b, l, h, p); dt (b, l, h), already positive (after softplus); A (h,), negative;
B, C (b, l, g, n) where the g groups divide the h heads (head i reads group i // (h // g));
D (h,) or None; initial_state (b, h, p, n) or None. Returns y (b, l, h, p) in x's dtype and the final
state (b, h, p, n) in float32 (float64 when x is float64, so that fp64 tests stay exact).
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

# the kernel file holds the input checks both paths share (it never imports this module)
from elephant.layers import inline_in_graph, ssd_triton
from elephant.layers.ssd_triton import check_joint, check_shapes

BACKENDS = ("auto", "ref", "triton")
_backend = os.environ.get("ELEPHANT_SSD", "auto")


def set_backend(name: str) -> None:
    """Force the path `ssd_scan` takes: 'auto' (Triton on CUDA, else reference), 'ref' or 'triton'."""
    global _backend
    _backend = _check_backend(name)


def get_backend() -> str:
    return _check_backend(_backend)


def _check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"ELEPHANT_SSD / set_backend: expected one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def ssd_scan(x, dt, A, B, C, D=None, initial_state=None, chunk_size: int = 64, seg=None,
             segment_init=None, joint=None):
    """The SSD scan through the path chosen by the backend switch (see module docstring); "auto"
    also takes the PyTorch path for a few tokens inside a compiled graph (`inline_in_graph`).

    joint: None, or the tensor (b, l, h p + 2 g n) whose column blocks [x | B | C] x, B and C are
    (views of it: the Mamba block's activated conv output, split). The Triton path reads them from
    it and returns their gradients as its one gradient (`ssd_triton`); the PyTorch path takes x, B
    and C as given, and autograd reaches joint through the views."""
    check_joint(joint, x, B)
    args = (x, dt, A, B, C, D, initial_state, chunk_size, seg, segment_init)
    if takes_triton(x, B, chunk_size):
        return ssd_triton.ssd_triton(*args, joint=joint)
    return ssd_chunked(*args)


def takes_triton(x, B, chunk_size: int) -> bool:
    """Whether `ssd_scan` takes the Triton path for x (b, l, h, p) and B (b, l, g, n)."""
    backend = get_backend()
    if backend != "auto":
        return backend == "triton"
    return (x.is_cuda and ssd_triton.supports(x, B, chunk_size)
            and not inline_in_graph(x, x.shape[0] * x.shape[1]))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; every other dtype is computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def ssd_recurrent_ref(x, dt, A, B, C, D=None, initial_state=None, seg=None, segment_init=None):
    """Token-by-token recurrence; the ground truth. O(l) Python steps: tests only.

    With `seg`, the state restarts where the segment id changes: from zero, or from
    `segment_init` (h, p, n) when given (the ground truth of `add_segment_init`)."""
    check_shapes(x, dt, A, B, C, D, initial_state, seg, segment_init)
    with torch.autocast(x.device.type, enabled=False):
        return _ssd_recurrent(x, dt, A, B, C, D, initial_state, seg, segment_init)


def _ssd_recurrent(x, dt, A, B, C, D, initial_state, seg=None, segment_init=None):
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    cdt = compute_dtype(x)
    x, dt, A, B, C = (t.to(cdt) for t in (x, dt, A, B, C))
    B = B.repeat_interleave(h // g, dim=2)  # (b, l, h, n)
    C = C.repeat_interleave(h // g, dim=2)
    s = (x.new_zeros(b, h, p, n) if initial_state is None else initial_state.to(cdt))
    ys = []
    prev = torch.zeros(b, dtype=torch.long, device=x.device)
    restart = 0.0 if segment_init is None else segment_init.to(cdt)
    for t in range(l):
        if seg is not None:  # a new segment: the state before its first token is the restart state
            new = (seg[:, t] != prev)[:, None, None, None]
            s = torch.where(new, restart, s)
            prev = seg[:, t]
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]                    # (b, h, 1, 1)
        write = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None]  # (b, h, p, n)
        s = decay * s + write
        ys.append(torch.einsum("bhpn,bhn->bhp", s, C[:, t]))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(b, 0, h, p)
    if D is not None:
        y = y + D.to(cdt)[:, None] * x
    return y, s


def ssd_chunked(x, dt, A, B, C, D=None, initial_state=None, chunk_size: int = 64, seg=None,
                segment_init=None):
    """Chunked SSD in PyTorch; any length (the tail is padded with dt = 0: no decay, no write)."""
    check_shapes(x, dt, A, B, C, D, initial_state, seg, segment_init)
    with torch.autocast(x.device.type, enabled=False):  # float32 products even under autocast
        return _ssd_chunked(x, dt, A, B, C, D, initial_state, chunk_size, seg, segment_init)


def segment_masks(seg, nc: int, Q: int):
    """For `seg` (b, l): padded segment ids (b, nc, Q) (the tail repeats the last id) and, per chunk,
    own (b, nc, Q): token j is in the chunk's last segment (it writes the state the chunk passes on);
    incoming (b, nc, Q): token i is in the segment of the token before the chunk (it reads the
    incoming state; the token before chunk 0 counts as segment 0); passes (b, nc): the chunk has no
    boundary, so the incoming state goes through it."""
    b, l = seg.shape
    seg = seg.long()
    if nc * Q > l:
        seg = torch.cat([seg, seg[:, -1:].expand(b, nc * Q - l)], dim=1)
    segc = seg.view(b, nc, Q)
    before = torch.cat([seg.new_zeros(b, 1), segc[:, :-1, -1]], dim=1)   # (b, nc)
    own = segc == segc[:, :, -1:]
    incoming = segc == before[:, :, None]
    passes = segc[:, :, -1] == before
    return segc, own, incoming, passes


def segment_cumsum(v, seg):
    """Cumulative sum of v (..., L, k) along L that restarts where seg (..., L) changes.

    A masked product with the (L, L) same-segment lower triangle, in float64: each sum holds only
    its own segment's terms (a plain cumsum and a difference would carry the earlier segments'
    rounding, and their gradient would cancel only up to rounding), so one document's decays are
    bitwise independent of the document before it. L is a chunk (<= 128) or the number of chunks.
    """
    L = seg.shape[-1]
    causal = torch.ones(L, L, dtype=torch.bool, device=seg.device).tril()
    mask = causal & (seg[..., :, None] == seg[..., None, :])
    return torch.matmul(mask.to(torch.float64), v.to(torch.float64)).to(v.dtype)


def _ssd_chunked(x, dt, A, B, C, D, initial_state, chunk_size, seg=None, segment_init=None):
    """With segment_init S0, a segment starting at token a of chunk c has the state
    exp(cs_t) S0 + (its own writes) at its token t, cs_t the log decay summed from a to t (the
    restarting cumsum). So S0 enters in two places: the tokens of a segment that starts inside
    their chunk read exp(cs_t) S0 C_t (step 4, beside the incoming state's term, which only the
    segment entering the chunk reads), and a chunk whose last segment starts inside it passes on
    exp(cs_end) S0 beside its own writes (step 2; such a chunk passes nothing else on). A segment
    that spans several chunks carries S0 on in the passed state like any other state."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r = h // g                                   # heads per group
    Q = chunk_size
    nc = max(1, math.ceil(l / Q))
    pad = nc * Q - l
    cdt = compute_dtype(x)
    xf, dtf, Bf, Cf = (t.to(cdt) for t in (x, dt, B, C))
    if pad:
        xf, Bf, Cf = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xf, Bf, Cf))
        dtf = F.pad(dtf, (0, 0, 0, pad))
    xdt = (xf * dtf[..., None]).view(b, nc, Q, g, r, p)                  # (b, c, Q, g, r, p)
    Bc = Bf.view(b, nc, Q, g, n)
    Cc = Cf.view(b, nc, Q, g, n)
    dA = (dtf * A.to(cdt)).view(b, nc, Q, h)
    if seg is None:
        cs = dA.cumsum(2)
    else:  # restarting at each boundary
        segc, own, incoming, passes = segment_masks(seg, nc, Q)
        cs = segment_cumsum(dA, segc)
    cs = cs.view(b, nc, Q, g, r).permute(0, 1, 3, 4, 2)                  # (b, c, g, r, Q)

    # 1. inside each chunk: y_i = sum_{j <= i} exp(cs_i - cs_j) (C_i . B_j) dt_j x_j
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    if seg is not None:  # and j in i's segment: the decay across a boundary is exactly 0
        causal = causal & (segc[..., :, None] == segc[..., None, :])[:, :, None, None]
    decay = torch.exp((cs[..., :, None] - cs[..., None, :]).masked_fill(~causal, -math.inf))
    CB = torch.einsum("bcign,bcjgn->bcgij", Cc, Bc)                     # (b, c, g, Q, Q)
    y = torch.einsum("bcgrij,bcjgrp->bcigrp", CB[:, :, :, None] * decay, xdt)

    # 2. each chunk's own contribution to the state at its end
    to_end = cs[..., -1:] - cs                                            # (b, c, g, r, Q)
    if seg is not None:  # only the chunk's last segment writes the state it passes on
        to_end = to_end.masked_fill(~own[:, :, None, None, :], -math.inf)
    to_end = torch.exp(to_end)
    states = torch.einsum("bcjgn,bcgrj,bcjgrp->bcgrpn", Bc, to_end, xdt)  # (b, c, g, r, p, n)
    if segment_init is not None:  # a chunk whose last segment starts inside it: S0 decayed to the end
        s0 = segment_init.to(cdt).reshape(g, r, p, n)
        s0_end = torch.exp(cs[..., -1].masked_fill(passes[:, :, None, None], -math.inf))  # (b, c, g, r)
        states = states + s0_end[..., None, None] * s0

    # 3. pass states from chunk to chunk: states_in[c] = state before chunk c (incl. initial state)
    init = (xf.new_zeros(b, g, r, p, n) if initial_state is None
            else initial_state.to(cdt).reshape(b, g, r, p, n))
    states = torch.cat([init[:, None], states], dim=1)                    # (b, c + 1, g, r, p, n)
    last = F.pad(cs[..., -1], (0, 0, 0, 0, 1, 0))                         # (b, c + 1, g, r)
    causal_c = torch.ones(nc + 1, nc + 1, dtype=torch.bool, device=x.device).tril()
    if seg is None:
        lc = last.cumsum(1)
    else:  # state z' reaches state z only through chunks z' .. z-1 without a boundary
        blocked = F.pad((~passes).long().cumsum(1), (1, 0))                  # (b, c + 1)
        causal_c = causal_c & (blocked[:, :, None] == blocked[:, None, :])[:, None, None]
        lc = segment_cumsum(last.reshape(b, nc + 1, h), blocked).view(b, nc + 1, g, r)
    lc = lc.permute(0, 2, 3, 1)                                           # (b, g, r, c + 1)
    chunk_decay = torch.exp((lc[..., :, None] - lc[..., None, :]).masked_fill(~causal_c, -math.inf))
    states = torch.einsum("bgrzc,bcgrpn->bzgrpn", chunk_decay, states)
    states_in, final = states[:, :-1], states[:, -1]

    # 4. the incoming state's contribution: y_i += exp(cs_i) states_in C_i
    into = cs
    if seg is not None:  # only the tokens of the segment the incoming state belongs to
        into = into.masked_fill(~incoming[:, :, None, None, :], -math.inf)
    into = torch.exp(into)
    y = y + torch.einsum("bcign,bcgrpn,bcgri->bcigrp", Cc, states_in, into)
    if segment_init is not None:  # the other tokens: their segment starts in the chunk, from S0
        fresh = torch.exp(cs.masked_fill(incoming[:, :, None, None, :], -math.inf))
        y = y + torch.einsum("bcign,grpn,bcgri->bcigrp", Cc, s0, fresh)

    y = y.reshape(b, nc * Q, h, p)[:, :l]
    if D is not None:
        y = y + D.to(cdt)[:, None] * xf[:, :l]
    return y.to(x.dtype), final.reshape(b, h, p, n)


def add_segment_init(y, final, dt, A, C, seg, segment_init, chunk_size: int = 64):
    """Make every segment after the first start from `segment_init` (h, p, n) instead of zero.

    Adds to a zero-restarting scan's output y (b, l, h, p) the term C_t . exp(sum_{a<=k<=t} dt_k A)
    segment_init for each token t of a segment starting at a (seg > 0), and to the final state the
    same decayed state when the last segment is not segment 0. Linear in the state, so this equals
    the scan restarted from segment_init (held equal to ssd_recurrent_ref in the tests). The log
    decays are summed per segment in float64, in blocks of `chunk_size` with a carry from block to
    block, so a segment's sums hold only its own terms. The carry is itself a segment sum, over the
    blocks' totals, restarting at each block that holds a boundary: no loop over the blocks.
    """
    b, l, h, p = y.shape
    g = C.shape[2]
    cdt = compute_dtype(y)
    Q = chunk_size
    nc = max(1, math.ceil(l / Q))
    dA = F.pad(dt.double() * A.double(), (0, 0, 0, nc * Q - l)).view(b, nc, Q, h)
    segc, own, incoming, passes = segment_masks(seg, nc, Q)
    cs = segment_cumsum(dA, segc)                                            # (b, nc, Q, h)
    # the log decay of block c's last segment up to its end: its own part in block c, plus the
    # blocks before it back to the one where it began (runs of blocks: a new one at each boundary)
    after = segment_cumsum(cs[:, :, -1], (~passes).long().cumsum(1))         # (b, nc, h)
    carry = F.pad(after[:, :-1], (0, 0, 1, 0))                              # into block c
    total = cs + torch.where(incoming[..., None], carry[:, :, None], 0.0)
    total = total.view(b, nc * Q, h)[:, :l]
    decay = torch.exp(total.masked_fill(~(seg > 0)[..., None], -math.inf)).to(cdt)   # (b, l, h)
    Ch = C.to(cdt).repeat_interleave(h // g, dim=2)                          # (b, l, h, n)
    init = segment_init.to(cdt)
    y = y + (torch.einsum("blhn,hpn->blhp", Ch, init) * decay[..., None]).to(y.dtype)
    final = final + (decay[:, -1, :, None, None] * init).to(final.dtype)
    return y, final

