"""Kept tokens (model.kv_keep): the attention layers' long-term memory past the KV window."""
import math

import pytest
import torch
from torch.nn import functional as F

from elephant.config import ConfigError, ModelConfig
from elephant.model import ElephantLM
from elephant.recall import ablate
from elephant.state import KVCache
from tiny_lm import assert_same_run, chunks_with_grads, tiny_lm

V = 40


def make(seed=0, **kw) -> ElephantLM:
    return tiny_lm(seed, **(dict(vocab_size=V, layers="A", kv_window=4, kv_keep=1, bptt_chunks=8) | kw))


def favour(model, token: int, layer: int = 0) -> None:
    """Make `token` the best-scored token of the first layer (whose input is the embedding)."""
    mixer = model.blocks[layer].mixer
    with torch.no_grad():
        e = model.blocks[layer].norm1(model.embed.weight[token])
        mixer.keep_w.copy_(e / e.norm() * 20)
        mixer.keep_b.zero_()


def test_with_kept_takes_the_best_valid_scores():
    B, H, K, T, hd, D = 2, 1, 2, 3, 2, 3
    cache = KVCache(k=torch.zeros(B, H, 1, hd), v=torch.zeros(B, H, 1, hd),
                    valid=torch.zeros(B, 1, dtype=torch.bool),
                    keep_k=torch.full((B, H, K, hd), -1.0), keep_v=torch.full((B, H, K, hd), -1.0),
                    keep_x=torch.full((B, K, D), -1.0), keep_pos=torch.tensor([[100, 101]] * B),
                    keep_valid=torch.tensor([[True, False]] * B))
    k = torch.arange(T, dtype=torch.float).view(1, 1, T, 1).expand(B, H, T, hd)
    x = torch.arange(T, dtype=torch.float).view(1, T, 1).expand(B, T, D)
    pos = torch.tensor([[5, 6, 7]] * B)
    valid = torch.tensor([[True, True, False], [True, True, True]])
    # scores of [kept 0, kept 1 (invalid), tokens 0, 1, 2 (lane 0: 2 invalid)]
    score = torch.tensor([[0.5, 9.0, 0.1, 0.7, 5.0], [0.5, 9.0, 0.1, 0.7, 5.0]])
    out = cache.with_kept(k, k, x, pos, valid, score)
    assert out.keep_pos.tolist() == [[6, 100], [7, 6]]
    assert out.keep_valid.all()
    assert out.keep_k[0, 0, :, 0].tolist() == [1.0, -1.0] and out.keep_x[1, :, 0].tolist() == [2.0, 1.0]
    # a lane whose document ended (keep false) drops its old kept tokens
    out = cache.with_kept(k, k, x, pos, valid, score, keep=torch.tensor([False, True]))
    assert out.keep_pos[0].tolist() == [6, 5] and out.keep_pos[1].tolist() == [7, 6]
    assert out.k is cache.k    # the window is left to append


def test_a_kept_token_is_carried_bit_for_bit_while_lower_scores_pass():
    model = make(kv_keep=1)
    favour(model, 7)
    T = 4
    gen = torch.Generator().manual_seed(0)
    state = None
    first = torch.tensor([[3, 7, 5, 2]])
    _, state = model(first, state)
    kept = {n: t.clone() for n, t in state.kv[0].fields().items() if n.startswith("keep_")}
    assert kept["keep_pos"].item() == 1 and kept["keep_valid"].item()
    for _ in range(6):
        filler = torch.randint(8, V, (1, T), generator=gen)
        _, state = model(filler, state)
        for n, t in kept.items():
            assert torch.equal(getattr(state.kv[0], n), t), n


def test_a_kept_token_reads_the_same_however_far_back_it_is():
    # one layer, the favoured token kept alone: the query chunk's logits are the same after 2 or
    # after 7 chunks of the same filler, though the token is 12 or 32 tokens back (the window
    # holds the same filler, and a kept token is read at a fixed distance before the window)
    model = make(kv_keep=1)
    favour(model, 7)
    filler, query = torch.tensor([[9, 10, 11, 12]]), torch.tensor([[13, 7, 14, 15]])
    outs = []
    for gap in (2, 7):
        _, state = model(torch.tensor([[3, 7, 5, 2]]))
        for _ in range(gap):
            _, state = model(filler, state)
        logits, _ = model(query, state)
        outs.append(logits)
    assert (outs[0] - outs[1]).abs().max() < 1e-12
    # and the kept token does change them: without it the logits differ
    _, state = model(torch.tensor([[3, 7, 5, 2]]))
    for _ in range(2):
        _, state = model(filler, state)
    state = ablate(model, state, "keep")
    logits, _ = model(query, state)
    assert (logits - outs[0]).abs().max() > 1e-6


def test_kept_tokens_are_hidden_while_in_the_window():
    # a token enters the kept set at its chunk's end, but is read from the window until it leaves
    model = make(kv_keep=1, kv_window=8)
    favour(model, 7)
    _, state = model(torch.tensor([[3, 7, 5, 2]]))
    reader = model.blocks[0].mixer
    _, _, visible = reader.kept_tokens(state.kv[0], state.pos)
    assert not visible.any()                      # position 1 is inside the window [0, 4) + 4
    _, state = model(torch.tensor([[9, 10, 11, 12]]), state)
    _, state = model(torch.tensor([[9, 10, 11, 12]]), state)
    _, _, visible = reader.kept_tokens(state.kv[0], state.pos)
    assert visible.all()                          # start 12 - window 8 = 4 > position 1


def test_the_keep_score_learns_from_a_later_chunk():
    # the loss of a chunk that reads a kept token reaches the keep score's parameters (through
    # sigmoid(score) on the kept value), though the kept keys and values carry no gradient
    model = make(kv_keep=2, layers="AA").train()
    model.cfg.kv_keep_noise = 0.0
    state = None
    for c in range(3):
        tokens = torch.randint(0, V, (2, 4))
        loss, state = model(tokens, state, targets=tokens)
    for block in model.blocks:
        g = torch.autograd.grad(loss, [block.mixer.keep_w, block.mixer.keep_b], retain_graph=True)
        assert all(t.abs().sum() > 0 for t in g)


def test_the_keep_cost_charges_the_mean_kept_gate_per_token_and_lowers_every_kept_score():
    # model.kv_keep_cost: cost x tokens x the lanes' mean gate over every attention layer's kept
    # slots (an empty slot 0), in training only; its gradient reaches the keep scores alone and
    # lowers each (the kept inputs carry none)
    model = make(kv_keep=3, layers="AMA", kv_keep_noise=0.0, kv_keep_cost=0.25).train()
    state = None
    for c in range(2):
        _, state = model(torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(c)), state)
    gates = []
    for block, cache in zip(model.blocks, state.kv):
        if block.kind == "A":
            s = (cache.keep_x.double() @ block.mixer.keep_w.detach().double()) + block.mixer.keep_b.detach()
            gates.append(torch.sigmoid(s) * cache.keep_valid)
    assert state.kv[0].keep_valid.all() and not torch.cat(gates, 1).eq(0).all()
    want = 0.25 * 8 * torch.cat(gates, 1).mean(1).sum()
    cost = model.keep_cost(state, 8)
    torch.testing.assert_close(cost, want.to(cost.dtype))
    mixers = [b.mixer for b in model.blocks if b.kind == "A"]
    grads = torch.autograd.grad(cost, [m.keep_b for m in mixers] + [m.keep_w for m in mixers])
    assert all(g.item() > 0 for g in grads[:2])          # a step down the gradient lowers them
    assert all(g.abs().sum() > 0 for g in grads[2:])
    model.eval()
    assert model.keep_cost(state, 8) is None              # evaluation: the cross-entropy alone
    assert make(kv_keep=3, kv_keep_cost=0.0).train().keep_cost(state, 8) is None
    with pytest.raises(ConfigError, match="kv_keep_cost"):
        ModelConfig(kv_keep=8, kv_window=8, kv_keep_cost=-1.0).validate()


def test_the_softplus_keep_cost_pushes_hardest_on_the_best_scored_kept_tokens():
    # model.kv_keep_cost_form = "softplus": each kept slot is charged softplus(score) =
    # -log(1 - gate), whose slope is the gate itself; the gate's own charge has slope
    # gate (1 - gate), which fades for the best-scored tokens (those a fact must outrank)
    model = make(kv_keep=3, layers="AMA", kv_keep_noise=0.0, kv_keep_cost=0.25,
                 kv_keep_cost_form="softplus").train()
    state = None
    for c in range(2):
        _, state = model(torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(c)), state)
    mixers = [b.mixer for b in model.blocks if b.kind == "A"]
    caches = [c for b, c in zip(model.blocks, state.kv) if b.kind == "A"]
    scores = [(c.keep_x.double() @ m.keep_w.detach().double()) + m.keep_b.detach() for m, c in zip(mixers, caches)]
    valid = torch.cat([c.keep_valid for c in caches], 1).double()
    s = torch.cat(scores, 1)
    cost = model.keep_cost(state, 8)
    torch.testing.assert_close(cost, (0.25 * 8 * (F.softplus(s) * valid).mean(1).sum()).to(cost.dtype))
    # the slope on each layer's bias: the mean over the lane's slots of the gate (softplus) ...
    slope = torch.autograd.grad(cost, [m.keep_b for m in mixers])
    gate = torch.sigmoid(s) * valid
    K = caches[0].keep_valid.shape[1]
    for i, g in enumerate(slope):
        want = 0.25 * 8 * gate[:, i * K:(i + 1) * K].sum() / s.shape[1]
        torch.testing.assert_close(g.double().sum(), want, rtol=1e-4, atol=1e-6)
    # ... where the gate's charge has gate (1 - gate): at a score of 4, 1/(1 - 0.982) = 55x less
    t = torch.tensor(4.0, requires_grad=True)
    soft, = torch.autograd.grad(F.softplus(t), t)
    sig, = torch.autograd.grad(torch.sigmoid(t), t)
    assert soft / sig > 50
    with pytest.raises(ConfigError, match="kv_keep_cost_form"):
        ModelConfig(kv_keep=8, kv_window=8, kv_keep_cost_form="hinge").validate()


def test_exploration_noise_only_while_training():
    model = make(kv_keep=2, kv_window=4)
    tokens = torch.randint(0, V, (4, 4), generator=torch.Generator().manual_seed(3))
    picks = []
    for training in (False, False, True, True):
        model.train(training)
        torch.manual_seed(len(picks))
        _, state = model(tokens)
        picks.append(state.kv[0].keep_pos.sort(1).values)
    assert torch.equal(picks[0], picks[1])                # evaluation: the scores alone decide
    assert not torch.equal(picks[2], picks[3]) or not torch.equal(picks[2], picks[0])


def test_dropped_kept_tokens_are_refilled_by_later_tokens_only_while_training():
    # kv_keep_drop: in training, a lane whose kept set is dropped after a chunk carries on only
    # what that chunk offers (in every layer); the other lanes and evaluation are untouched
    model = make(kv_keep=1, layers="AA", kv_keep_noise=0.0, kv_keep_drop=0.5)
    favour(model, 7)
    first, filler = torch.tensor([[3, 7, 5, 2]] * 16), torch.tensor([[9, 10, 11, 12]] * 16)
    for training in (False, True):
        model.train(training)
        torch.manual_seed(0)
        _, state = model(first)
        assert (state.kv[0].keep_pos == 1).all()           # the favoured token, kept everywhere
        _, state = model(filler, state)
        held = state.kv[0].keep_pos[:, 0] == 1              # (B,) lanes that still hold it
        if not training:
            assert held.all()
            continue
        assert 0 < held.sum() < 16                          # 16 lanes at 1/2: some of each
        assert (state.kv[0].keep_pos[~held, 0] >= 4).all()  # refilled from the filler chunk
        assert torch.equal(state.kv[1].keep_pos[:, 0] < 4, held)   # every layer drops alike
    with pytest.raises(ConfigError, match="kv_keep_drop"):
        ModelConfig(kv_keep=8, kv_window=8, kv_keep_drop=1.0).validate()


def test_kept_tokens_need_a_window():
    with pytest.raises(ConfigError, match="kv_keep"):
        ModelConfig(kv_keep=8, kv_window=0).validate()
    with pytest.raises(ConfigError, match="kv_keep"):
        ModelConfig(kv_keep=-1, kv_window=8).validate()


def test_kept_tokens_round_trip_through_the_state_dict():
    model = make(kv_keep=3, layers="MA")
    _, state = model(torch.randint(0, V, (2, 4)))
    _, state = model(torch.randint(0, V, (2, 4)), state)
    saved = state.state_dict()
    assert {"kv.1.keep_k", "kv.1.keep_x", "kv.1.keep_pos", "kv.1.keep_valid"} <= set(saved)
    fresh = model.init_state(2, dtype=torch.float64)
    fresh.load_state_dict(saved)
    for n, t in state.tensors().items():
        assert torch.equal(fresh.tensors()[n], t), n
    cleared = state.reset(torch.tensor([True, False]))
    assert not cleared.kv[1].keep_valid[0].any() and torch.equal(cleared.kv[1].keep_valid[1],
                                                                  state.kv[1].keep_valid[1])


@pytest.mark.parametrize("mem_rotary", ["chunk", "free", "none"])
def test_a_chunk_computes_the_same_at_any_depth_of_its_document(mem_rotary):
    # with the memory at the chunk's positions (mem_rotary "chunk") or scored without rotary
    # ("free"), every position the model uses is relative (window keys, kept tokens, memory), so
    # a document read from position 10^6 gives the logits of the same document read from 0;
    # unrotated memory tokens do not
    model = make(layers="MAMA", n_mem=2, kv_window=4, kv_keep=3, mem_rotary=mem_rotary)
    tokens = torch.randint(0, V, (2, 5, 4), generator=torch.Generator().manual_seed(4))
    outs = []
    for offset in (0, 10 ** 6):
        state = model.init_state(2, dtype=torch.float64)
        state.pos += offset
        logits = []
        for c in range(5):
            out, state = model(tokens[:, c], state)
            logits.append(out)
        outs.append(torch.cat(logits, 1))
    diff = (outs[0] - outs[1]).abs().max().item()
    assert diff < 1e-9 if mem_rotary != "none" else diff > 1e-4, diff


def test_free_memory_scores_are_the_unrotated_dot_product_at_any_query_position():
    # free_scores: a query scores a memory key by q.k without rotary, wherever it stands, and a
    # sequence key by rot(q).rot(k), exactly what the explicit two-part score gives
    from elephant.layers.attention import free_scores, rotary_cos_sin, apply_rotary
    g = torch.Generator().manual_seed(0)
    B, H, S, hd = 2, 3, 7, 8
    q_raw, k_raw = (torch.randn(B, H, S, hd, generator=g, dtype=torch.float64) for _ in range(2))
    free = torch.tensor([True, True, False, False, False, False, True])
    scores = []
    for offset in (0, 12345):
        pos = torch.arange(S).expand(B, S) + offset
        cos, sin = rotary_cos_sin(pos, hd, 10000.0, torch.float64)
        q, k = apply_rotary(q_raw, cos, sin), apply_rotary(k_raw, cos, sin)
        qa, ka = free_scores(q, q_raw, k, k_raw, free)
        got = qa @ ka.mT / math.sqrt(2 * hd)                         # what SDPA computes
        want = torch.where(free.view(1, 1, 1, S), q_raw @ k_raw.mT, q @ k.mT) / math.sqrt(hd)
        assert torch.allclose(got, want, atol=1e-12)
        scores.append(got[..., free])
    assert torch.allclose(scores[0], scores[1], atol=1e-12)      # memory: the same from any position


@pytest.mark.parametrize("packed", [False, True])
def test_kept_tokens_by_the_varlen_kernel_equal_the_masked_path(monkeypatch, packed):
    """With kept tokens, attention reads [kept | window] by the variable-length kernel (its kernel
    replaced by what FlashAttention computes, as on the GPU), as it reads a window alone: the
    logits, states and gradients of the masked path, over chunks where kept tokens are hidden,
    then visible, with lanes whose documents start at chunk starts and (packed) inside chunks.
    Each attention layer makes its own packed layout: its kept tokens are its own."""
    from elephant.layers import attention
    from test_attention import varlen_reference
    model = make(layers="AMA", n_mem=2, kv_window=4, kv_keep=2)
    B, T, n = 3, 4, 6
    gen = torch.Generator().manual_seed(5)
    chunks = torch.randint(0, V, (n, B, T), generator=gen)
    starts = [None] * n
    if packed:
        for c, (lane, col) in {2: (1, 2), 4: (0, 1), 5: (2, 3)}.items():
            starts[c] = torch.zeros(B, T, dtype=torch.bool)
            starts[c][lane, col] = True

    def run():
        return chunks_with_grads(model, chunks, starts)

    want = run()
    visible = model.blocks[0].mixer.kept_tokens(want[1].kv[0], want[1].pos)[2]
    assert visible.any() and not visible.all()             # some kept tokens read, some hidden
    calls, layouts = [], []
    plain_varlen, plain_segments = attention.attend_varlen, attention.attend_segments_varlen
    plain_layout = attention.segment_layout

    def counted(fn):
        def call(*args, **kw):
            calls.append(fn.__name__)
            return fn(*args, **kw)
        return call

    def counted_layout(*args):
        layouts.append(args[2])                                # the cache's slots: K + W
        return plain_layout(*args)
    monkeypatch.setattr(attention, "varlen_supported", lambda q, v: True)
    monkeypatch.setattr(attention, "flash_varlen", varlen_reference)
    monkeypatch.setattr(attention, "attend_varlen", counted(plain_varlen))
    monkeypatch.setattr(attention, "attend_segments_varlen", counted(plain_segments))
    monkeypatch.setattr(attention, "segment_layout", counted_layout)
    got = run()
    # every chunk of both attention layers by the kernel: packed ones by their layout
    inner = sum(s is not None for s in starts)
    assert calls.count("attend_varlen") == 2 * (n - inner) and len(calls) == 2 * n
    assert layouts == [2 + 4] * 2 * inner                  # one layout per layer and packed chunk
    assert "blocks.0.mixer.keep_w" in got[2]
    assert_same_run(got, want)


def test_more_kept_slots_at_inference_keep_what_fewer_keep_and_change_nothing_they_do_not_fill(tmp_path):
    """model.kv_keep is a capacity, not part of the weights (from_pretrained(kv_keep=)): a model
    trained with 2 kept tokens, given 6, keeps the 2 it kept and more, and each query reads the 2
    of them it scores highest (kv_keep_read, as in training); given more slots than tokens ever
    leave its window, it computes what any larger capacity computes."""
    from elephant.hub import HubError, from_pretrained, save_pretrained
    T, n = 4, 6   # 6 chunks of 4 through a window of 4
    model = make(seed=3, kv_keep=2)
    with torch.no_grad():   # a keep score that ranks the tokens by id, so no two tie
        model.blocks[0].mixer.keep_w.copy_(torch.randn(model.cfg.d_model, dtype=torch.float64))
    save_pretrained(model, tmp_path / "m")
    chunks = torch.randint(0, V, (n, 2, T), generator=torch.Generator().manual_seed(1))

    def stream(m):
        """The logits of `chunks` run in order through m with carried state, and the positions
        each lane keeps at the end."""
        state, logits = None, []
        for c in chunks:
            out, state = m(c, state)
            logits.append(out)
        kv = state.kv[0]
        return torch.stack(logits), [set(kv.keep_pos[b][kv.keep_valid[b]].tolist()) for b in range(2)]

    def run(kv_keep):
        m, _, config = from_pretrained(tmp_path / "m", kv_keep=kv_keep)
        assert m.cfg.kv_keep == config["model"]["kv_keep"] == kv_keep
        assert m.cfg.kv_keep_read == config["model"]["kv_keep_read"] == 2   # what it read in training
        return stream(m.double())

    small, kept2 = run(2)
    torch.testing.assert_close(small, stream(model)[0])   # as trained: the model it was saved from
    more, kept6 = run(6)
    assert all(len(k) == 2 for k in kept2) and all(len(k) == 6 for k in kept6)
    assert all(a < b for a, b in zip(kept2, kept6))         # the 2 best are among the 6 best
    assert not torch.allclose(small[-1], more[-1])           # and the 4 more are read
    big, kept_all = run(n * T)                               # room for every token read
    assert all(len(k) == n * T for k in kept_all)           # (those still in the window hidden)
    torch.testing.assert_close(big, run(64)[0], rtol=1e-12, atol=1e-12)   # empty slots: rounding
    with pytest.raises(HubError, match="at least 1 kept token"):
        from_pretrained(tmp_path / "m", kv_keep=0)
    save_pretrained(make(kv_keep=0), tmp_path / "none")
    with pytest.raises(HubError, match="trained without kept tokens"):
        from_pretrained(tmp_path / "none", kv_keep=4)


@pytest.mark.parametrize("free", [False, True])
def test_each_query_reads_only_the_kept_tokens_it_scores_highest(free):
    """model.kv_keep_read = r < kv_keep: every head's every query attends to the r valid kept
    tokens whose keys it scores highest, then the window and the chunk, as an explicit softmax over
    just those keys computes (position-free memory scores too)."""
    model = make(seed=2, layers="A", kv_window=3, kv_keep=6, kv_keep_read=2, kv_keep_noise=0.0,
                 n_mem=2 if free else 0, mem_rotary="free" if free else "none")
    with torch.no_grad():   # scores that rank the tokens apart
        model.blocks[0].mixer.keep_w.copy_(torch.randn(model.cfg.d_model, dtype=torch.float64))
    T = 3
    chunks = torch.randint(0, V, (5, 2, T), generator=torch.Generator().manual_seed(3))
    state = None
    for c in chunks[:-1]:
        _, state = model(c, state)
    cache, mixer = state.kv[0], model.blocks[0].mixer
    assert cache.keep_valid.sum(1).min() > 2          # more kept than a query may read
    B, S, D = 2, 4, model.cfg.d_model
    x = torch.randn(B, S, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    pos = state.pos[:, None] + torch.arange(S)
    fr = torch.tensor([True, False, False, False]) if free else None
    extra = dict(free=fr) if free else {}
    y = mixer(x, pos, cache.k, cache.v, cache.valid, kept=cache, start=state.pos, **extra)[0]

    with torch.no_grad():
        q, k, v, k_raw, q_raw = mixer.project(x, pos, raw=True, raw_q=True)
    kk, kv, kvalid = mixer.kept_tokens(cache, state.pos)
    if free:   # the memory token's key scored without rotary
        k = torch.where(fr[None, None, :, None], k_raw, k)
    want = torch.zeros(B, mixer.n_heads, S, mixer.head_dim, dtype=torch.float64)
    for b in range(B):
        for h in range(mixer.n_heads):
            for i in range(S):
                kept = [j for j in range(kk.shape[2]) if kvalid[b, j]]
                kept = sorted(kept, key=lambda j: -float(q[b, h, i] @ kk[b, h, j]))[:2]
                window = [j for j in range(3) if cache.valid[b, j]]
                keys = [kk[b, h, j] for j in kept] + [cache.k[b, h, j] for j in window]
                vals = [kv[b, h, j] for j in kept] + [cache.v[b, h, j] for j in window]
                logits = [q[b, h, i] @ key for key in keys]
                for j in range(i + 1):   # the chunk; a memory key scored without rotary
                    memory = free and bool(fr[j])
                    logits.append((q_raw if memory else q)[b, h, i] @ k[b, h, j])
                    vals.append(v[b, h, j])
                p = torch.softmax(torch.stack(logits) / math.sqrt(mixer.head_dim), 0)
                want[b, h, i] = p @ torch.stack(vals)
    want = mixer.o(want.transpose(1, 2).reshape(B, S, D))
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-10)


def test_a_model_keeps_its_inference_capacity_when_loaded_and_an_explicit_one_wins(tmp_path):
    """model.kv_keep_infer: from_pretrained holds that many kept tokens, each query reading the
    kv_keep it trained with; kv_keep= and kv_keep_read= override both, and what is loaded says
    what it holds (kv_keep_infer spent), so that saving and loading it again changes nothing."""
    from elephant.hub import HubError, from_pretrained, save_pretrained
    save_pretrained(make(kv_keep=2, kv_keep_infer=6), tmp_path / "m")
    m, _, config = from_pretrained(tmp_path / "m")
    assert (m.cfg.kv_keep, m.cfg.kv_keep_read, m.cfg.kv_keep_infer) == (6, 2, 0)
    assert config["model"]["kv_keep"] == 6
    assert m.blocks[0].mixer.keep_read == 2 and m.init_state(1).kv[0].keep_k.shape[2] == 6
    save_pretrained(m, tmp_path / "again")
    assert from_pretrained(tmp_path / "again")[0].cfg.kv_keep == 6
    m = from_pretrained(tmp_path / "m", kv_keep=3, kv_keep_read=0)[0]
    assert (m.cfg.kv_keep, m.cfg.kv_keep_read) == (3, 0)                   # read all 3
    assert from_pretrained(tmp_path / "m", kv_keep_read=1)[0].cfg.kv_keep == 6
    with pytest.raises(HubError, match="kv_keep_read -1"):
        from_pretrained(tmp_path / "m", kv_keep_read=-1)
    with pytest.raises(ConfigError, match="kv_keep_infer"):
        ModelConfig(kv_window=4, kv_keep=0, kv_keep_infer=8).validate()


# ------------------------------------------------------------------ the two-part kept read
def varlen_lse_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale, padded=False):
    """What FlashAttention's varlen kernel returns with its log-sum-exp: out (total_q, H, hd) as
    test_attention.varlen_reference, lse (H, total_q) of each query's scaled scores (`padded`:
    (sequences, H, max_q), the layout before FlashAttention 2.6)."""
    from test_attention import varlen_reference
    lse = q.new_zeros(q.shape[1], q.shape[0])
    lse_padded = q.new_zeros(len(cu_q) - 1, q.shape[1], max_q)
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = (int(t) for t in (cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]))
        nq, nk = q1 - q0, k1 - k0
        if nq:
            scores = torch.einsum("qhd,khd->hqk", q[q0:q1], k[k0:k1]) * scale
            seen = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
            lse[:, q0:q1] = scores.masked_fill(~seen, float("-inf")).logsumexp(-1)
            lse_padded[i, :, :nq] = lse[:, q0:q1]
    return varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale), lse_padded if padded else lse


def kept_read_case(dtype, free: bool, seed: int = 0):
    """Queries, chunk keys and values (B, H, S, hd), a window of W slots and K kept tokens for
    4 lanes: (0) a full window, every kept token valid; (1) an empty window, 5 of 7 kept tokens
    valid, not the first ones; (2) the window's last 2 slots, 2 kept tokens valid (fewer than a
    query reads); (3) the last 3 slots and no kept token. With `free`, the first query is a
    memory token scored without rotary (`free_scores`): the scores' doubled q and k."""
    from elephant.layers.attention import free_scores
    g = torch.Generator().manual_seed(seed)
    B, H, S, W, K, hd = 4, 2, 5, 6, 7, 8
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k, v, q_raw, k_raw = (r(B, H, S, hd) for _ in range(5))
    cache_k, cache_v, kept_k, kept_v = r(B, H, W, hd), r(B, H, W, hd), r(B, H, K, hd), r(B, H, K, hd)
    slot = torch.arange(W)
    cache_valid = slot[None, :] >= torch.tensor([0, W, W - 2, W - 3])[:, None]   # a suffix per lane
    kept_valid = torch.zeros(B, K, dtype=torch.bool)
    kept_valid[0] = True
    kept_valid[1, [1, 2, 4, 5, 6]] = True
    kept_valid[2, [3, 6]] = True
    qa, ka = q, k
    if free:
        qa, ka = free_scores(q, q_raw, k, k_raw, torch.arange(S) == 0)
    return q, qa, ka, v, cache_k, cache_v, cache_valid, kept_k, kept_v, kept_valid


def masked_kept_read(q, qa, ka, v, cache_k, cache_v, cache_valid, kept_k, kept_v, kept_valid, read):
    """Today's masked path of Attention.forward: each query's choice (`kept_top`) as a mask per
    head and query over [kept | window], then SDPA over [kept | window | chunk]."""
    from elephant.layers.attention import attend_reference, kept_top, pad_sequence_keys
    free = qa.shape[-1] != q.shape[-1]
    keys = torch.cat([kept_k, cache_k], dim=2)
    keys = pad_sequence_keys(keys) if free else keys
    B, H, S, _ = q.shape
    seen = kept_top(qa, keys[:, :, :kept_k.shape[2]], kept_valid, read)
    valid = torch.cat([seen, cache_valid[:, None, None, :].expand(B, H, S, -1)], dim=-1)
    return attend_reference(qa, ka, v, keys, torch.cat([kept_v, cache_v], dim=2), valid)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("free", [False, True])
@pytest.mark.parametrize("varlen", ["no", "flash", "flash-padded-lse"])
def test_the_two_part_kept_read_equals_the_masked_path(monkeypatch, dtype, free, varlen):
    """attend_top_kept: [window | chunk] (written out, or by the variable-length kernel, its kernel
    replaced by what FlashAttention returns, its log-sum-exp in either layout) merged by
    log-sum-exp with each query's best 3 of 7 kept tokens gives what the per-query mask over
    [kept | window | chunk] gives, for lanes with full, empty and partly valid windows and all,
    some, fewer than 3 and no valid kept tokens, with position-free memory's doubled scores too."""
    from elephant.layers import attention
    case = kept_read_case(dtype, free)
    q, qa, ka, v, cache_k, cache_v, cache_valid, kept_k, kept_v, kept_valid = case
    want = masked_kept_read(*case, read=3)
    calls = []
    if varlen != "no":
        def kernel(*args):
            calls.append(args[0].shape)
            return varlen_lse_reference(*args, padded=varlen == "flash-padded-lse")
        monkeypatch.setattr(attention, "varlen_supported", lambda q, v: True)
        monkeypatch.setattr(attention, "flash_varlen_lse", kernel)
    window_k = attention.pad_sequence_keys(cache_k) if free else cache_k
    got = attention.attend_top_kept(qa, ka, v, window_k, cache_v, cache_valid, q, kept_k, kept_v,
                                    kept_valid, 3)
    # the kernel saw the lanes' S queries and values padded to the scores' head dims
    assert calls == ([(4 * 5, 2, qa.shape[-1])] if varlen != "no" else [])
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert got.dtype == dtype and got.shape == v.shape
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_the_kept_read_by_blocks_of_lanes_equals_one_block(monkeypatch):
    """top_kept_read takes the lanes in blocks of KEPT_READ_BLOCK score elements: a lane at a
    time gives what all four at once give."""
    from elephant.layers import kept_read
    q, _, _, _, _, _, _, kept_k, kept_v, kept_valid = kept_read_case(torch.float64, False)
    whole = kept_read.top_kept_read(q, kept_k, kept_v, kept_valid, 3, 0.3)
    H, S, K = q.shape[1], q.shape[2], kept_k.shape[2]
    monkeypatch.setattr(kept_read, "KEPT_READ_BLOCK", H * S * K)
    lanes = kept_read.top_kept_read(q, kept_k, kept_v, kept_valid, 3, 0.3)
    assert torch.isinf(whole[1][3]).all() and torch.isfinite(whole[1][:3]).all()  # lane 3: none
    for a, b in zip(lanes, whole):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mem_rotary", ["none", "free"])
def test_a_loaded_model_reads_its_best_kept_tokens_alike_by_the_two_part_read_and_the_mask(
        tmp_path, monkeypatch, mem_rotary):
    """from_pretrained(kv_keep=6) of a model that read 2 kept tokens in training: its chunked
    forward takes the two-part read where no gradient is recorded (inference) and the per-query
    mask where one is (training), and both give the same logits and states (float64), over
    chunks where lanes hold more kept tokens than they read, and one lane starts a new document
    (no kept token). A packed chunk (documents starting inside it) takes the mask either way."""
    from elephant.hub import from_pretrained, save_pretrained
    from elephant.layers import attention
    model = make(seed=3, layers="AMA", kv_keep=2, n_mem=2 if mem_rotary == "free" else 0,
                 mem_rotary=mem_rotary)
    with torch.no_grad():   # keep scores that rank the tokens apart
        for block in model.blocks:
            if block.kind == "A":
                block.mixer.keep_w.copy_(torch.randn(model.cfg.d_model, dtype=torch.float64))
    save_pretrained(model, tmp_path / "m")
    loaded = from_pretrained(tmp_path / "m", kv_keep=6)[0].double()
    assert loaded.blocks[0].mixer.keep_read == 2
    B, T, n = 3, 4, 7
    chunks = torch.randint(0, V, (n, B, T), generator=torch.Generator().manual_seed(1))
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[2, 2] = True                                  # the last chunk: packed
    calls = []
    plain = attention.attend_top_kept

    def counted(*args, **kw):
        calls.append(args[7].shape)                      # the kept keys read
        return plain(*args, **kw)
    monkeypatch.setattr(attention, "attend_top_kept", counted)

    def stream(grad: bool):
        state, logits, held = None, [], []
        with torch.set_grad_enabled(grad):
            for c in range(n):
                reset = torch.tensor([False, True, False]) if c == 4 else None
                out, state = loaded(chunks[c], state, reset, starts=starts if c == n - 1 else None)
                logits.append(out.detach())
                held.append(state.kv[0].keep_valid.sum(1))
        return torch.stack(logits), state, torch.stack(held)

    fast, fast_state, held = stream(False)
    # every chunk but the packed one, both attention layers, read apart (the first from an
    # empty state)
    assert calls == [(B, loaded.cfg.n_heads, 6, loaded.cfg.head_dim)] * 2 * (n - 1)
    assert held[3].min() > 2                             # more kept than a query reads
    assert held[4, 1] == T < held[4, 0]                  # the new document's tokens alone
    calls.clear()
    masked, masked_state, _ = stream(True)
    assert calls == []
    torch.testing.assert_close(fast, masked, rtol=1e-10, atol=1e-10)
    for name, t in fast_state.tensors().items():
        torch.testing.assert_close(t, masked_state.tensors()[name].detach(), rtol=1e-10,
                                   atol=1e-10, msg=name)
