"""The attention layer's associative memory (model.kv_assoc, layers/assoc.py): the write is the
delta rule over the tokens that leave the window, in order, at the strength of their keep gate;
a query before rotary equal to a written key reads its value; the memory is cleared with its
document, dropped alone by `--drop assoc`, carried in float32 through checkpoints and dtype moves;
the read gate and the queries learn through it; the decoder's step path equals the chunked
forward."""
import pytest
import torch
import torch.nn.functional as F

from elephant.config import ConfigError, ModelConfig
from elephant.generate import Decoder
from elephant.layers.assoc import assoc_read, assoc_write
from elephant.layers.attention import rotate_at
from elephant.layers.delta import delta_rule_recurrent
from elephant.state import KVCache, carried_parts, check_parts, drop_parts, parse_parts
from tiny_lm import tiny_lm

V = 97


def make(seed=0, open_gate=True, **kw):
    """A tiny fp64 model with the memory; `open_gate`: read gates and keep scores that vary."""
    model = tiny_lm(seed, **(dict(vocab_size=V, kv_window=4, kv_keep=3, kv_assoc=True) | kw))
    if open_gate:
        with torch.no_grad():
            for block in model.blocks:
                if block.kind == "A":
                    block.mixer.assoc_b.fill_(1.0)
                    block.mixer.assoc_w.normal_(std=0.5)
                    block.mixer.keep_w.normal_()
    return model


def reference_write(S, k, v, beta):
    """Token by token: the delta rule with the keys normalized and no decay."""
    kn = F.normalize(k, dim=-1).transpose(1, 2)
    b = beta[:, :, None].expand(-1, -1, k.shape[1])
    _, S = delta_rule_recurrent(kn, kn, v.transpose(1, 2), b, torch.zeros_like(b), initial_state=S)
    return S


def test_write_is_the_delta_rule_and_reads_back_what_it_wrote():
    g = torch.Generator().manual_seed(0)
    B, H, n, hd = 2, 3, 70, 8       # more tokens than one block of the chunked form
    S0 = torch.randn(B, H, hd, hd, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, n, hd, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, n, hd, generator=g, dtype=torch.float64)
    beta = torch.rand(B, n, generator=g, dtype=torch.float64)
    beta[:, 5] = 0.0
    torch.testing.assert_close(assoc_write(S0, k, v, beta), reference_write(S0, k, v, beta))
    # a token written at full strength is what a read with its key returns, whatever S held
    last = assoc_write(S0, k[:, :, :1], v[:, :, :1], torch.ones(B, 1, dtype=torch.float64))
    torch.testing.assert_close(assoc_read(last, 3.0 * k[:, :, :1]), v[:, :, :1])
    # strength 0 writes nothing
    assert torch.equal(assoc_write(S0, k, v, torch.zeros_like(beta)), S0)


@pytest.mark.parametrize("keep", [None, torch.tensor([True, False])])
def test_the_tokens_leaving_the_window_are_written_in_order(keep):
    g = torch.Generator().manual_seed(1)
    B, H, W, n, hd = 2, 2, 4, 3, 8
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)   # noqa: E731
    cache = KVCache(k=r(B, H, W, hd), v=r(B, H, W, hd),
                    valid=torch.tensor([[False, True, True, True], [True] * 4]),
                    raw_k=r(B, H, W, hd), score=r(B, W), assoc=r(B, H, hd, hd))
    k, v, raw, score = r(B, H, n, hd), r(B, H, n, hd), r(B, H, n, hd), r(B, n)
    new = cache.append(k, v, keep=keep, raw_k=raw, score=score)
    # the window and its raw keys and scores roll alike: the last W of [window | new]
    torch.testing.assert_close(new.raw_k, torch.cat([cache.raw_k, raw], 2)[:, :, -W:])
    torch.testing.assert_close(new.score, torch.cat([cache.score, score], 1)[:, -W:])
    torch.testing.assert_close(new.k, torch.cat([cache.k, k], 2)[:, :, -W:])
    # what left is the window's first n slots, each written at sigmoid(score) if it was valid
    valid = cache.valid if keep is None else cache.valid & keep[:, None]
    beta = torch.sigmoid(cache.score[:, :n]) * valid[:, :n]
    S = cache.assoc if keep is None else cache.assoc * keep[:, None, None, None]
    want = reference_write(S, cache.raw_k[:, :, :n], cache.v[:, :, :n], beta)
    torch.testing.assert_close(new.assoc, want)
    # kv_assoc_writes: only the 2 of highest score among the valid ones leaving, in their order
    two = cache.append(k, v, keep=keep, raw_k=raw, score=score, writes=2)
    S2 = []
    for b in range(B):
        ok = [j for j in range(n) if valid[b, j]]
        best = sorted(sorted(ok, key=lambda j: -float(cache.score[b, j]))[:2])
        S2.append(reference_write(S[b:b + 1], cache.raw_k[b:b + 1, :, best],
                                  cache.v[b:b + 1, :, best], beta[b:b + 1, best]))
    torch.testing.assert_close(two.assoc, torch.cat(S2))
    if keep is None:   # lane 1 has 3 valid tokens leaving: one of them is not written
        assert not torch.allclose(two.assoc[1], new.assoc[1])
    with pytest.raises(ValueError, match="raw_k"):
        cache.append(k, v)


def test_a_query_that_scores_a_key_past_the_window_reads_its_value():
    # the query at offset 2 into its chunk that attention would match best with the key at
    # distance W + 1 + 2 (its rotation undone) reads the key's value from the memory
    model = make(layers="A", kv_window=4, kv_keep=2)
    mixer = model.blocks[0].mixer
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 5, 32, generator=g, dtype=torch.float64)
    key = torch.randn(1, 4, 1, 8, generator=g, dtype=torch.float64)
    value = torch.randn(1, 4, 1, 8, generator=g, dtype=torch.float64)
    S = assoc_write(torch.zeros(1, 4, 8, 8, dtype=torch.float64), key, value,
                    torch.ones(1, 1, dtype=torch.float64))
    q = torch.randn(1, 4, 5, 8, generator=g, dtype=torch.float64)
    q[:, :, 2:3] = rotate_at(2.0 * key, torch.tensor([-(4 + 1 + 2)]), mixer.rope_base)
    read = mixer.assoc_read(x, q, S, None, torch.arange(5))
    # the same query one place later is turned one step further: it reads less of the value
    moved = mixer.assoc_read(x, q[:, :, [1, 2, 3, 4, 0]], S, None, torch.arange(5))[:, :, 1]
    assert (moved - gate_read(mixer, x, value)[:, :, 1]).abs().sum() > 1e-3
    torch.testing.assert_close(read[:, :, 2], gate_read(mixer, x, value)[:, :, 2])
    seg = torch.tensor([[0, 0, 1, 1, 1]])     # a document that began inside the chunk reads none
    assert read[:, :, 2].abs().sum() > 0
    assert mixer.assoc_read(x, q, S, seg, torch.arange(5))[:, :, 2:].abs().sum() == 0


def gate_read(mixer, x, value):
    """(1, H, S, hd): each position's gate times the value."""
    gate = torch.sigmoid(x @ mixer.assoc_w + mixer.assoc_b)           # (1, S, H)
    return gate.transpose(1, 2)[..., None] * value[:, :, :1]


def test_the_memory_carries_reads_and_learns_in_the_model():
    model = make().train()
    model.cfg.kv_keep_noise = 0.0
    tokens = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(3))
    state = None
    for _ in range(3):
        _, state = model(tokens, state, targets=tokens)
    S = [c.assoc for c in state.kv if c is not None]
    assert S and all(s.dtype == torch.float64 and s.abs().sum() > 0 for s in S)
    # the read matters: the same chunk with the memory emptied gives other logits
    model.eval()
    full, _ = model(tokens, state)
    empty, _ = model(tokens, drop_parts(state, ("assoc",)))
    assert (full - empty).abs().max() > 1e-6
    # the gate and the queries learn from the read; the write carries no gradient
    model.train().zero_grad()
    loss, _ = model(tokens, state.detach(), targets=tokens)
    loss.backward()
    mixer = model.blocks[1].mixer
    assert mixer.assoc_w.grad.abs().sum() > 0 and mixer.assoc_b.grad.abs().sum() > 0
    emptied = model(tokens, drop_parts(state, ("assoc",)).detach(), targets=tokens)[0]
    model.zero_grad()
    emptied.backward()
    assert mixer.assoc_w.grad.abs().sum() == 0      # nothing to read: the gate learns nothing


def test_reset_drop_and_parts():
    model = make()
    tokens = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(4))
    state = None
    for _ in range(3):
        _, state = model(tokens, state)
    reset = state.reset(torch.tensor([True, False]))
    for c, r in zip(state.kv, reset.kv):
        if c is not None:
            assert r.assoc[0].abs().sum() == 0 and torch.equal(r.assoc[1], c.assoc[1])
    dropped = drop_parts(state, ("assoc",))
    for c, d in zip(state.kv, dropped.kv):
        if c is not None:   # the memory alone is cleared
            assert d.assoc.abs().sum() == 0
            assert torch.equal(d.keep_valid, c.keep_valid) and torch.equal(d.k, c.k)
    assert "assoc" in carried_parts(model.cfg) and parse_parts("assoc") == ("assoc",)
    with pytest.raises(ConfigError, match="no assoc"):
        check_parts(("assoc",), make(kv_assoc=False, open_gate=False).cfg)


def test_state_keeps_the_memory_in_float32_through_moves_and_checkpoints():
    model = make()
    state = model.init_state(2, dtype=torch.bfloat16)
    c = next(c for c in state.kv if c is not None)
    assert c.assoc.dtype == torch.float32 and c.score.dtype == torch.float32
    moved = state.to(dtype=torch.bfloat16)
    c = next(c for c in moved.kv if c is not None)
    assert c.assoc.dtype == torch.float32 and c.raw_k.dtype == torch.bfloat16
    tokens = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(5))
    state = None
    for _ in range(3):
        _, state = model(tokens, state)
    again = model.init_state(2)
    again.load_state_dict(state.state_dict())
    for name, t in state.tensors().items():
        assert torch.equal(again.tensors()[name], t), name


def test_config_needs_kept_tokens():
    with pytest.raises(ConfigError, match="kv_assoc"):
        ModelConfig(vocab_size=V, kv_window=8, kv_assoc=True).validate()
    with pytest.raises(ConfigError, match="kv_assoc_writes"):
        ModelConfig(vocab_size=V, kv_window=8, kv_keep=2, kv_assoc=True,
                    kv_assoc_writes=-1).validate()


@pytest.mark.parametrize("n_mem, kv_window, writes", [(0, 3, 0), (2, 5, 0), (0, 8, 0), (0, 3, 2)])
def test_step_path_equals_chunked_forward(n_mem, kv_window, writes):
    # windows shorter than, as long as and longer than the chunk; lane 1 starts a new document;
    # `writes`: kv_assoc_writes
    T = 5
    model = make(n_mem=n_mem, kv_window=kv_window, kv_keep=3, kv_assoc_writes=writes)
    tokens = torch.randint(0, V, (2, 5 * T + 2), generator=torch.Generator().manual_seed(6))
    state, want = None, []
    for c in range(0, tokens.shape[1], T):
        reset = torch.tensor([False, True]) if c == 3 * T else None
        logits, state = model(tokens[:, c:c + T], state, reset)
        want.append(logits)
    want = torch.cat(want, dim=1)
    dec, got = Decoder(model, 2, T), []
    for t in range(tokens.shape[1]):
        if t == 3 * T:
            dec.reset([False, True])
        got.append(dec.step(tokens[:, t]))
    assert (torch.stack(got, 1) - want).abs().max().item() < 1e-9
    assert all(buf["assoc"].abs().sum() > 0 for buf in dec.kept.values())
