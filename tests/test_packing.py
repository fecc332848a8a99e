"""Packed documents (issue 11): documents back to back inside a chunk, with `starts` (B, T) marking
each document's first token. A document never sees the one before it (attention masked by document,
KV window included; Mamba conv and SSM state restarted; rotary positions from 0; the learned initial
memory, not the lane's), and a document that starts mid-chunk is the same as one that starts a chunk."""
import pytest
import torch
import torch.nn.functional as F

from elephant.config import ModelConfig
from elephant.layers.mamba import Mamba2, segment_conv, segment_conv_reference
from elephant.model import ElephantLM
from tiny_lm import assert_same_run, chunks_with_grads, packed_and_alone, tiny_lm

V = 97


def make(seed=0, **kw) -> ElephantLM:
    return tiny_lm(seed, **({"vocab_size": V} | kw))


def starts_at(B, T, *cols) -> torch.Tensor:
    s = torch.zeros(B, T, dtype=torch.bool)
    for c in cols:
        s[:, c] = True
    return s


@pytest.mark.parametrize("n_mem, kv_window, kv_keep, mem_rotary, attn_x0, layers",
                         [(3, 16, 0, "none", False, "MAMA"), (0, 16, 0, "none", False, "MAMA"),
                          (3, 0, 0, "none", False, "MAMA"), (3, 16, 4, "none", False, "MAMA"),
                          (3, 16, 4, "free", False, "MAMA"), (3, 16, 4, "free", True, "MAMA"),
                          (3, 16, 4, "none", False, "MDAD")])
def test_previous_document_never_leaks_into_the_next(n_mem, kv_window, kv_keep, mem_rotary,
                                                     attn_x0, layers, **kw):
    # Lane 0: doc A runs over chunk 0 and into chunk 1, doc B starts at token 7 of chunk 1 and runs
    # on into chunk 2. Changing every token of doc A leaves doc B's logits bitwise unchanged (with
    # kept tokens: doc A's tokens 0-7 would be readable in chunk 2, had B not started).
    model = make(n_mem=n_mem, kv_window=kv_window, kv_keep=kv_keep, mem_rotary=mem_rotary,
                 attn_x0=attn_x0, layers=layers, **kw)
    T, b0 = 12, 7
    gen = torch.Generator().manual_seed(1)
    chunks = torch.randint(0, V, (3, 2, T), generator=gen)
    starts = [starts_at(2, T, 0), starts_at(2, T, b0), starts_at(2, T)]
    other = chunks.clone()
    other[0] = torch.randint(0, V, (2, T), generator=gen)
    other[1, :, :b0] = torch.randint(0, V, (2, b0), generator=gen)

    def run(chunks):
        state, outs = None, []
        for c in range(3):
            logits, state = model(chunks[c], state, starts=starts[c])
            outs.append(logits)
        return outs, state
    a, state_a = run(chunks)
    b, state_b = run(other)
    assert torch.equal(a[1][:, b0:], b[1][:, b0:]) and torch.equal(a[2], b[2])
    assert not torch.equal(a[1][:, :b0], b[1][:, :b0])  # doc A itself did change
    for name, t in state_a.tensors().items():
        assert torch.equal(t, state_b.tensors()[name]), name


@pytest.mark.parametrize("n_mem, kv_window", [(3, 16), (0, 4)])
def test_previous_document_never_leaks_through_the_associative_memory(n_mem, kv_window):
    # model.kv_assoc: doc A's tokens leave the window (a window shorter than the chunk: some in
    # the chunk where doc B starts) but are never written where doc B reads
    test_previous_document_never_leaks_into_the_next(n_mem, kv_window, 4, "none", False, "MAMA",
                                                     kv_assoc=True)


@pytest.mark.parametrize("layers", ["MAMA", "AMMA", "MM", "AA", "MDAD"])
def test_document_starting_mid_chunk_equals_document_fed_alone(layers):
    # memory off, a window covering the document: doc B starting at token 7 of a chunk and running on
    # into the next two chunks gives the logits of one pass over doc B in a fresh state
    model = make(layers=layers, kv_window=64)
    T = 16
    gen = torch.Generator().manual_seed(2)
    doc_a = torch.randint(0, V, (1, 20), generator=gen)
    doc_b = torch.randint(0, V, (1, 30), generator=gen)
    alone, _ = model(doc_b)
    _, state = model(doc_a[:, :13])                          # doc A's first chunk
    stream = torch.cat([doc_a[:, 13:20], doc_b], dim=1)     # 7 tokens of A, then B (starts at 7)
    stream = torch.cat([stream, torch.randint(0, V, (1, 3 * T - stream.shape[1]), generator=gen)], 1)
    outs = []
    for c in range(3):
        s = torch.zeros(1, T, dtype=torch.bool)
        if c == 0:
            s[0, 7] = True
        if c == 2:
            s[0, 37 - 2 * T] = True  # doc C starts after doc B (at 7 + 30 = 37)
        logits, state = model(stream[:, c * T:(c + 1) * T], state, starts=s)
        outs.append(logits)
    packed = torch.cat(outs, dim=1)[:, 7:37]
    assert (packed - alone).abs().max() < 1e-10


@pytest.mark.parametrize("layers, mem_update, mem_rotary, attn_x0",
                         [("MAMA", "gated", "none", False), ("AMMA", "replace", "none", False),
                          ("MM", "gated", "none", False), ("MAMA", "gated", "chunk", False),
                          ("AMMA", "gated", "free", False), ("AMMA", "gated", "free", True),
                          ("MDAD", "gated", "none", False)])
def test_document_starting_mid_chunk_sees_initial_memory(layers, mem_update, mem_rotary, attn_x0):
    # memory on: doc B starting at token 5 of a chunk (and filling it) gives the logits, and leaves the
    # state, of doc B starting a chunk of its own after a reset; so does the chunk after that
    model = make(layers=layers, n_mem=3, kv_window=16, mem_update=mem_update, mem_rotary=mem_rotary,
                 attn_x0=attn_x0)
    T, b0 = 14, 5
    gen = torch.Generator().manual_seed(3)
    doc_b = torch.randint(0, V, (2, T - b0 + 9), generator=gen)
    _, state = model(torch.randint(0, V, (2, 10), generator=gen))            # doc A's first chunk
    packed_in = torch.cat([torch.randint(0, V, (2, b0), generator=gen), doc_b[:, :T - b0]], dim=1)
    packed, s_packed = model(packed_in, state, starts=starts_at(2, T, b0))
    reset, s_reset = model(doc_b[:, :T - b0], state, torch.ones(2, dtype=torch.bool))
    assert (packed[:, b0:] - reset).abs().max() < 1e-10
    assert torch.equal(s_packed.pos, s_reset.pos)
    nxt = doc_b[:, T - b0:]
    after_packed, _ = model(nxt, s_packed, starts=starts_at(2, nxt.shape[1]))
    after_reset, _ = model(nxt, s_reset)
    assert (after_packed - after_reset).abs().max() < 1e-10


@pytest.mark.parametrize("layers", ["MAMA", "MDAD"])
def test_gradients_do_not_cross_a_document_boundary(layers):
    # the loss of doc B (starting mid-chunk) has no gradient into doc A's tokens, in this chunk or
    # the one before, nor into the state doc A carried in
    model = make(n_mem=3, kv_window=16, bptt_chunks=4, layers=layers)
    embedded = []
    handle = model.embed.register_forward_hook(lambda m, a, out: embedded.append(out))
    T, b0 = 12, 6
    _, state = model(torch.randint(0, V, (2, T)))                      # doc A's first chunk
    logits, _ = model(torch.randint(0, V, (2, T)), state, starts=starts_at(2, T, b0))
    handle.remove()
    loss_b = logits[:, b0:].pow(2).sum()
    g_prev, g_this = torch.autograd.grad(loss_b, embedded, retain_graph=True)
    assert not g_prev.any() and not g_this[:, :b0].any() and g_this[:, b0:].abs().sum() > 0
    # and doc A's loss does not reach doc B's tokens (causality, kept by the mask)
    (g_a,) = torch.autograd.grad(logits[:, :b0].pow(2).sum(), embedded[1], retain_graph=True)
    assert not g_a[:, b0:].any()
    # doc B's loss does reach the parameters of the initial memory
    (g_mem,) = torch.autograd.grad(loss_b, model.mem_init, retain_graph=True)
    assert g_mem.abs().sum() > 0


def test_a_wrong_count_of_inner_starts_is_refused():
    model = make(n_mem=2, kv_window=8)
    starts = starts_at(2, 9, 0, 4)                                     # 2 inner starts
    with pytest.raises(ValueError, match="inner_starts=3, but starts marks 2"):
        model(torch.randint(0, V, (2, 9)), starts=starts, inner_starts=3)
    model(torch.randint(0, V, (2, 9)), starts=starts, inner_starts=2)


def test_a_start_at_token_0_is_a_reset():
    model = make(n_mem=2, kv_window=8)
    _, state = model(torch.randint(0, V, (3, 9)))
    tokens = torch.randint(0, V, (3, 9))
    flags = torch.tensor([True, False, True])
    by_reset, s1 = model(tokens, state, flags)
    starts = torch.zeros(3, 9, dtype=torch.bool)
    starts[:, 0] = flags
    by_starts, s2 = model(tokens, state, starts=starts)
    assert (by_reset - by_starts).abs().max() < 1e-12
    for name, t in s1.tensors().items():
        assert (t.double() - s2.tensors()[name].double()).abs().max() < 1e-12, name


def test_rotary_positions_restart_at_each_document():
    model = make(layers="A", kv_window=32)
    _, state = model(torch.randint(0, V, (1, 11)))
    _, s = model(torch.randint(0, V, (1, 10)), state, starts=starts_at(1, 10, 4))
    assert s.pos.tolist() == [6]
    _, s = model(torch.randint(0, V, (1, 10)), state, starts=starts_at(1, 10))
    assert s.pos.tolist() == [21]


# --- the Mamba-2 mixer ----------------------------------------------------------------------------

def mixer(seed=0) -> Mamba2:
    cfg = ModelConfig(vocab_size=V, d_model=32, n_heads=4, layers="M", d_mlp=0, d_state=16,
                      mamba_head_dim=16, expand=2, d_conv=4, ssd_chunk=8)
    torch.manual_seed(seed)
    m = Mamba2(cfg).double()
    with torch.no_grad():
        m.conv1d.bias.normal_()
    return m


@pytest.mark.parametrize("with_init", [False, True])
def test_conv_and_scan_restart_at_each_boundary(with_init):
    # each segment of a packed row equals the mixer run on that segment alone: segment 0 from the
    # carried state, later ones from zero (or from `init`: conv tail and SSM state)
    m = mixer()
    L = 29
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, L, 32, generator=gen, dtype=torch.float64)
    conv0, ssm0 = (torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in m.init_state(2))
    bounds = [0, 2, 3, 11, 12, 13, 26, L]  # segments of 1, 2, 8 and 13 tokens; the last one of 3
    init = None
    if with_init:
        init = (torch.randn(m.conv_dim, 3, generator=gen, dtype=torch.float64),
                torch.randn(m.heads, m.head_dim, m.d_state, generator=gen, dtype=torch.float64))
    (y, conv, ssm), alone = packed_and_alone(m, x, conv0, ssm0, bounds, init)
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        assert (y[:, a:b] - alone[k][0]).abs().max() < 1e-12, k
    _, conv_k, ssm_k = alone[-1]
    assert (conv - conv_k).abs().max() < 1e-12 and (ssm - ssm_k).abs().max() < 1e-12


def test_fused_segment_init_equals_the_separate_path():
    # the mixer with the scan taking ssm_init itself == the scan restarting from zero plus
    # add_segment_init (fused_segment_init = False): output, states and every gradient, fp64
    m = mixer()
    L = 29
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, L, 32, generator=gen, dtype=torch.float64, requires_grad=True)
    conv0, ssm0 = (torch.randn(t.shape, generator=gen, dtype=torch.float64).requires_grad_()
                   for t in m.init_state(2))
    tail = torch.randn(m.conv_dim, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    s_init = torch.randn(m.heads, m.head_dim, m.d_state, generator=gen, dtype=torch.float64,
                         requires_grad=True)
    seg = torch.zeros(2, L, dtype=torch.long)
    for a in (1, 2, 8, 16, 17, 28):                      # chunk 8: starts at chunk edges, in a row
        seg[0, a:] += 1
    seg[1, 0:] += 1                                      # row 1: a new document from token 0
    seg[1, 20:] += 1
    leaves = [x, conv0, ssm0, tail, s_init] + list(m.parameters())
    results = []
    for fused in (True, False):
        m.fused_segment_init = fused
        y, conv, ssm = m(x, conv0, ssm0, seg=seg, init=(tail, s_init))
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
        loss = (y * w).sum() + ssm.pow(2).sum() + conv.pow(2).sum()
        results.append((y, conv, ssm, torch.autograd.grad(loss, leaves)))
    del m.fused_segment_init
    (y1, c1, s1, g1), (y2, c2, s2, g2) = results
    assert (y1 - y2).abs().max() < 1e-12 and torch.equal(c1, c2) and (s1 - s2).abs().max() < 1e-12
    for a, r in zip(g1, g2):
        assert (a - r).abs().max() < 1e-10
    assert g1[4].abs().max() > 0


def test_segment_conv_without_boundaries_is_the_causal_conv():
    gen = torch.Generator().manual_seed(5)
    window = torch.randn(2, 6, 3 + 10, generator=gen, dtype=torch.float64)
    w, b = torch.randn(6, 1, 4, generator=gen, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    out, state = segment_conv(window, torch.zeros(2, 10, dtype=torch.long), w, b)
    assert (out - F.conv1d(window, w, b, groups=6)).abs().max() < 1e-12
    assert torch.equal(state, window[:, :, -3:])


@pytest.mark.parametrize("K, L", [(4, 29), (4, 2), (2, 9), (3, 17)])
@pytest.mark.parametrize("with_tail", [False, True])
def test_segment_conv_equals_its_reference_with_gradients(K, L, with_tail):
    # the fast form (tail added per "tokens into the segment", no per-token indexing) == the indexing
    # form, values, state and every gradient, fp64; segments of 1 and 2 tokens (shorter than the
    # taps), one starting at token 0 of row 1, one ending the row
    gen = torch.Generator().manual_seed(6)
    C = 5
    window = torch.randn(2, C, K - 1 + L, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, 1, K, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(C, generator=gen, dtype=torch.float64, requires_grad=True)
    tail = (torch.randn(C, K - 1, generator=gen, dtype=torch.float64, requires_grad=True)
            if with_tail else None)
    seg = torch.zeros(2, L, dtype=torch.long)
    for a in (1, 2, 4, 11, L - 1):
        if 0 < a < L:
            seg[0, a:] += 1
    seg[1] = (torch.arange(L) >= L // 2).long() + 1                  # row 1: segment 1 from token 0
    inputs = [t for t in (window, w, b, tail) if t is not None]
    outs = {}
    for name, fn in (("fast", segment_conv), ("ref", segment_conv_reference)):
        out, state = fn(window, seg, w, b, tail)
        gen_o = torch.Generator().manual_seed(7)
        loss = (out * torch.randn(out.shape, generator=gen_o, dtype=torch.float64)).sum() + \
            (state * torch.randn(state.shape, generator=gen_o, dtype=torch.float64)).sum()
        outs[name] = (out, state, torch.autograd.grad(loss, inputs))
    (o1, s1, g1), (o2, s2, g2) = outs["fast"], outs["ref"]
    assert (o1 - o2).abs().max() < 1e-12 and torch.equal(s1, s2)
    for a, r in zip(g1, g2):
        assert (a - r).abs().max() < 1e-12


def test_segment_conv_has_no_per_token_indexing_of_the_tail():
    # the GPU cost it avoids: a per-token gather from the (C, K-1) tail, whose backward scatters
    # with atomic adds into C x (K-1) addresses; the fast form reaches the tail through whole-tensor
    # slices only (checked on the autograd graph)
    gen = torch.Generator().manual_seed(8)
    window = torch.randn(2, 6, 3 + 12, generator=gen, requires_grad=True)
    tail = torch.randn(6, 3, generator=gen, requires_grad=True)
    w, b = torch.randn(6, 1, 4, generator=gen), torch.randn(6, generator=gen)
    seg = torch.zeros(2, 12, dtype=torch.long)
    seg[:, 5:] = 1

    def graph_ops(fn):
        out, state = fn(window, seg, w, b, tail)
        seen, todo = set(), [out.grad_fn, state.grad_fn]
        while todo:
            f = todo.pop()
            if f is None or f in seen:
                continue
            seen.add(f)
            todo.extend(g for g, _ in f.next_functions)
        return {type(f).__name__ for f in seen}
    assert "IndexBackward0" in graph_ops(segment_conv_reference)
    assert "IndexBackward0" not in graph_ops(segment_conv)


# --- the fast ways of feeding packed chunks (what the trainer does) --------------------------------

def test_prefix_computed_once_for_several_chunks_equals_per_chunk(monkeypatch):
    # the initial-memory prefix computed once and shared by the chunks backpropagated together,
    # either passed in (`prefix`) or computed by the window's first chunk with an inner start and
    # carried on by the state (the trainer's way): the same losses and the same gradients
    # (mem_init included) as computing it in every chunk
    model = make(n_mem=3, kv_window=16, bptt_chunks=3)
    T = 12
    gen = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, V, (3, 2, T + 1), generator=gen)
    # the first chunk has no inner start (it goes without `starts`, as the trainer sends it)
    starts = [None, starts_at(2, T, 3, 9), starts_at(2, T, 7)]
    computed = []
    real_prefix = model._prefix
    monkeypatch.setattr(model, "_prefix", lambda *a: computed.append(1) or real_prefix(*a))
    results = {}
    for how in ("chunk", "given", "state"):
        model.zero_grad()
        computed.clear()
        prefix = model.init_prefix() if how == "given" else None
        state, loss = model.init_state(2), 0.0
        for c in range(3):
            if how == "chunk":
                state.prefix = None
            nll, state = model(tokens[c, :, :-1], state, targets=tokens[c, :, 1:], reduction="sum",
                               starts=starts[c], prefix=prefix)
            loss = loss + nll
            if how == "state":   # computed by the first chunk that needs it, then carried
                assert (state.prefix is None) == (c == 0)
        loss.backward()
        assert len(computed) == {"chunk": 2, "given": 1, "state": 1}[how], how
        results[how] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                        if p.grad is not None})
        assert state.detach().prefix is None and state.clone().prefix is None
    l0, g0 = results["chunk"]
    assert "mem_init" in g0
    for how in ("given", "state"):
        l1, g1 = results[how]
        assert (l0 - l1).abs() < 1e-10 and g0.keys() == g1.keys(), how
        for name, g in g0.items():
            assert (g - g1[name]).abs().max() < 1e-10, (how, name)


def test_a_prefix_of_the_wrong_model_is_refused():
    model = make(n_mem=2, kv_window=8)
    with pytest.raises(ValueError, match="init_prefix"):
        model(torch.randint(0, V, (1, 6)), starts=starts_at(1, 6, 0, 3), prefix=[])


@pytest.mark.parametrize("n_mem, kv_keep", [(0, 0), (3, 0), (3, 5)])
def test_chunk_without_inner_start_takes_the_unpacked_path_exactly(n_mem, kv_keep):
    # a chunk where documents start at token 0 at most (the batcher's inner_starts is False): the
    # boundary path and the plain path (starts=None, reset = starts[:, 0]) agree, logits and state
    model = make(n_mem=n_mem, kv_window=8, kv_keep=kv_keep)
    gen = torch.Generator().manual_seed(10)
    _, state = model(torch.randint(0, V, (3, 11), generator=gen))
    _, state = model(torch.randint(0, V, (3, 11), generator=gen), state)  # kept tokens now read
    tokens = torch.randint(0, V, (3, 11), generator=gen)
    starts = torch.zeros(3, 11, dtype=torch.bool)
    starts[1, 0] = True
    packed, s1 = model(tokens, state, starts=starts)
    plain, s2 = model(tokens, state, starts[:, 0])
    assert (packed - plain).abs().max() < 1e-12
    for name, t in s1.tensors().items():
        assert (t.double() - s2.tensors()[name].double()).abs().max() < 1e-12, name


@pytest.mark.parametrize("kv_window", [8, 16, 30])
def test_window_valid_slots_stay_a_suffix(kv_window):
    # attention.attend_varlen (the CUDA path over the window) relies on it: every lane's valid
    # window slots are its last ones, after any chunk, with documents starting inside chunks and
    # at their first token, lanes reset, and windows shorter and longer than a chunk
    model = make(n_mem=2, kv_window=kv_window)
    B, T = 4, 12
    gen = torch.Generator().manual_seed(3)
    state = None
    seen_partial = False
    for c in range(8):
        tokens = torch.randint(0, V, (B, T), generator=gen)
        starts = torch.rand(B, T, generator=gen) < 0.12
        reset = torch.rand(B, generator=gen) < 0.2
        _, state = model(tokens, state, reset, starts=starts if c % 3 else None)
        for cache in state.kv:
            if cache is None:
                continue
            v = cache.valid.int()
            assert (v[:, 1:] >= v[:, :-1]).all(), (c, cache.valid)
            seen_partial |= bool(((v.sum(1) > 0) & (v.sum(1) < kv_window)).any())
    assert seen_partial   # the windows were not all full or all empty


@pytest.mark.parametrize("n_mem, kv_window", [(3, 16), (0, 16), (3, 0)])
def test_packed_chunks_by_the_varlen_layout_equal_the_masked_path(monkeypatch, n_mem, kv_window):
    """The model's packed chunks through attention's variable-length layout (its kernel replaced by
    what FlashAttention computes, as on the GPU) give the masked path's logits, states and
    gradients; a chunk with more inner starts than the layout's room takes the masked path. The
    two attention layers of a chunk share one layout (made by the first, read by the second)."""
    from elephant.layers import attention
    from test_attention import varlen_reference
    model = make(n_mem=n_mem, kv_window=kv_window, layers="AMA")
    B, T = 2, 12
    gen = torch.Generator().manual_seed(3)
    chunks = torch.randint(0, V, (3, B, T), generator=gen)
    many = starts_at(B, T, 1, 3, 4, 6, 8)                             # 10 inner starts > room 4
    starts = [starts_at(B, T, 0, 5), starts_at(B, T, 2, 9), many]
    starts[1][1, 2] = False                                           # lane 1: one start

    def run():
        return chunks_with_grads(model, chunks, starts)

    want = run()
    calls, made = [], []
    plain, plain_layout = attention.attend_segments_varlen, attention.segment_layout

    def counted(*args, **kw):
        calls.append(args[4])                                         # room
        return plain(*args, **kw)

    def counted_layout(*args):
        made.append(args[-1])                                         # room
        return plain_layout(*args)
    monkeypatch.setattr(attention, "varlen_supported", lambda q, v: True)
    monkeypatch.setattr(attention, "flash_varlen", varlen_reference)
    monkeypatch.setattr(attention, "attend_segments_varlen", counted)
    monkeypatch.setattr(attention, "segment_layout", counted_layout)
    got = run()
    assert calls == [B * attention.SEGMENT_ROOM] * 4                  # two A layers, two chunks
    assert made == [B * attention.SEGMENT_ROOM] * 2                   # one layout a chunk
    assert_same_run(got, want)


@pytest.mark.parametrize("compiled, attn_x0, assoc", [(False, False, False), (True, False, False),
                                                      (True, True, True)])
def test_forward_window_equals_the_chunks_one_by_one(compiled, attn_x0, assoc):
    # forward_window (a BPTT window's chunks in one call; compile_for("window") makes them one
    # graph): the summed loss, the gradients (mem_init included), the prefix handed on and the
    # state after the window are forward's chunk by chunk (fp64), for windows packed or not,
    # across a detach (the second window starts from a state that has been through bptt_chunks);
    # compiled: no graph break, and a window of a form seen before adds no graph. `assoc`: with
    # kept tokens and the associative memory (model.kv_assoc), its write inside the graph
    import torch._dynamo
    from torch._dynamo.utils import counters
    B, T, k = 2, 10, 2
    gen = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, V, (4 * k, B, T + 1), generator=gen)
    # packed: window 1 has inner starts in its second chunk, window 2 in both, windows 3 and 4
    # (the same form) in none
    starts = [None, starts_at(B, T, 4), starts_at(B, T, 2, 7), starts_at(B, T, 5), None, None,
              None, None]
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, -3:] = False
    results = []
    for windowed in (False, True):
        torch._dynamo.reset()
        counters.clear()
        extra = dict(kv_keep=3, kv_assoc=True, kv_keep_noise=0.0) if assoc else {}
        model = make(layers="MA", n_mem=2, kv_window=8, bptt_chunks=k, attn_x0=attn_x0,
                     **extra).train()
        if windowed and compiled:
            model.compile_for("window", backend="aot_eager")
        state, losses, graphs = model.init_state(B), [], []
        for w in range(4):
            model.zero_grad()
            chunks = [dict(tokens=tokens[c, :, :-1], targets=tokens[c, :, 1:], loss_mask=mask,
                           starts=starts[c]) for c in range(w * k, (w + 1) * k)]
            if windowed:
                loss, state = model.forward_window(chunks, state)
            else:
                loss = 0.0
                for chunk in chunks:
                    nll, state = model(state=state, reduction="sum", **chunk)
                    loss = loss + nll
            loss.backward()
            prefix = None if state.prefix is None else [t.detach() for e in state.prefix for t in e]
            losses.append((loss.detach(), prefix, {n: p.grad.clone() for n, p in
                                                   model.named_parameters() if p.grad is not None}))
            state = state.detach()
            graphs.append(counters["stats"]["unique_graphs"])
        final = {n: t.clone() for n, t in state.tensors().items()}
        results.append((losses, final))
        if windowed and compiled:
            assert not counters["graph_break"], dict(counters["graph_break"])
            # a graph for each window's form (which chunks have inner starts, and whether the
            # state comes fresh or carried past a detach); none for a form seen before
            assert 1 <= graphs[0] < graphs[1] < graphs[2] == graphs[3], graphs
    (want, want_state), (got, got_state) = results
    for (l0, p0, g0), (l1, p1, g1) in zip(want, got):
        torch.testing.assert_close(l1, l0, rtol=1e-12, atol=1e-12)
        assert (p0 is None) == (p1 is None)
        for a, b in zip(p1 or [], p0 or []):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert g0.keys() == g1.keys()
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], rtol=1e-9, atol=1e-12, msg=name)
    assert "mem_init" in want[1][2]
    assert want_state.keys() == got_state.keys()
    for name in want_state:
        torch.testing.assert_close(got_state[name], want_state[name], rtol=1e-12, atol=1e-12)


def test_forward_window_refuses_what_forward_would_not_take():
    model = make(n_mem=2, kv_window=8)
    tokens = torch.randint(0, V, (2, 9))
    chunk = dict(tokens=tokens[:, :-1], targets=tokens[:, 1:])
    with pytest.raises(ValueError, match="no chunk"):
        model.forward_window([])
    with pytest.raises(ValueError, match=r"unknown keys \['target'\]"):
        model.forward_window([dict(chunk, target=tokens)])
    with pytest.raises(ValueError, match=r"missing \['targets'\]"):
        model.forward_window([dict(tokens=chunk["tokens"])])
    with pytest.raises(ValueError, match="reduction"):
        model.forward_window([chunk], reduction="none")
    with pytest.raises(ValueError, match="lanes"):
        model.forward_window([chunk], model.init_state(3))
    with pytest.raises(ValueError, match="starts must be"):
        model.forward_window([dict(chunk, starts=torch.zeros(2, 3, dtype=torch.bool))])
    with pytest.raises(ValueError, match=r"same \(lanes, length\): \(2, 8\) then \(2, 5\)"):
        model.forward_window([chunk, dict(tokens=tokens[:, :5], targets=tokens[:, 1:6])])


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_forward_window_stacked_loss_equals_the_chunks_losses(reduction):
    # forward_window's summed loss is one head pass over its chunks stacked as lanes; with one
    # chunk's loss mask missing (every token counts) and another's float weights, the loss and
    # the gradients are forward's chunk by chunk (fp64), as is the mean, taken chunk by chunk
    B, T, k = 2, 10, 3
    gen = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, V, (k, B, T + 1), generator=gen)
    masks = [None, torch.rand(B, T, generator=gen, dtype=torch.float64),
             torch.rand(B, T, generator=gen) < 0.7]
    results = []
    for windowed in (False, True):
        model = make(layers="MA", n_mem=2, kv_window=8, bptt_chunks=k, mem_write_cost=0.01,
                     mem_gate_init=0.0).train()
        chunks = [dict(tokens=tokens[c, :, :-1], targets=tokens[c, :, 1:], loss_mask=masks[c])
                  for c in range(k)]
        state = model.init_state(B)
        if windowed:
            loss, state = model.forward_window(chunks, state, reduction=reduction)
        else:
            loss = 0.0
            for chunk in chunks:
                nll, state = model(state=state, reduction=reduction, **chunk)
                loss = loss + nll
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()
                                        if p.grad is not None}))
    (want, want_g), (got, got_g) = results
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert got_g.keys() == want_g.keys()
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], rtol=1e-9, atol=1e-12, msg=name)
