"""The chunk contract of ElephantLM (DESIGN.md): chunked == whole, resets, lane isolation,
gradient depth, memory read from the write slots, state round trips."""
import pytest
import torch

from elephant.config import ModelConfig
from elephant.model import ElephantLM
from elephant.state import RecurrentState


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_heads=4, layers="MAMA", d_mlp=48, d_state=16,
                mamba_head_dim=16, expand=2, d_conv=4, ssd_chunk=8, n_mem=0, kv_window=0)
    base.update(kw)
    return ModelConfig(**base)


def make(seed=0, dtype=torch.float64, **kw) -> ElephantLM:
    torch.manual_seed(seed)
    return ElephantLM(tiny(**kw)).to(dtype).eval()


def run_chunks(model, tokens, lengths, state=None):
    outs, start = [], 0
    for n in lengths:
        logits, state = model(tokens[:, start:start + n], state)
        outs.append(logits)
        start += n
    assert start == tokens.shape[1]
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("layers, attn_x0", [("MAMA", False), ("AMMA", False), ("MM", False),
                                             ("AA", False), ("MAMA", True), ("AA", True),
                                             ("MAMA", "norm"), ("MDAD", False)])
def test_chunked_equals_whole_document(layers, attn_x0):
    model = make(layers=layers, kv_window=64, attn_x0=bool(attn_x0), attn_x0_norm=attn_x0 == "norm")
    tokens = torch.randint(0, 97, (2, 50))
    whole, _ = model(tokens)
    # chunk lengths that are not multiples of the SSD block (8), nor of the conv width
    chunked, _ = run_chunks(model, tokens, [7, 1, 13, 8, 21])
    assert (whole - chunked).abs().max().item() < 1e-10


def test_chunked_equals_whole_with_cache_shorter_than_document_only_for_mamba():
    # kv_window smaller than the document: attention layers lose old keys, so only an all-Mamba
    # stack still equals the whole pass; the hybrid must differ (the window really limits attention).
    tokens = torch.randint(0, 97, (1, 40))
    mamba = make(layers="MM", kv_window=8)
    assert (mamba(tokens)[0] - run_chunks(mamba, tokens, [10, 10, 10, 10])[0]).abs().max() < 1e-10
    hybrid = make(layers="MA", kv_window=8)
    assert (hybrid(tokens)[0] - run_chunks(hybrid, tokens, [10, 10, 10, 10])[0]).abs().max() > 1e-6


def test_window_attention_sees_exactly_kv_window_previous_tokens():
    # With one attention layer, a chunk with a window W sees the same as a whole pass over its W
    # previous tokens and itself (positions only matter relatively). Deeper stacks differ: their
    # cached keys were computed from windowed outputs.
    W = 6
    model = make(layers="A", kv_window=W)
    tokens = torch.randint(0, 97, (1, 20))
    chunked, _ = run_chunks(model, tokens, [5, 5, 5, 5])
    tail, _ = model(tokens[:, 15 - W:20])
    assert (chunked[:, 15:20] - tail[:, W:]).abs().max() < 1e-10


@pytest.mark.parametrize("n_mem", [0, 3])
def test_reset_lane_forgets_previous_document(n_mem):
    model = make(n_mem=n_mem, kv_window=16)
    doc = torch.randint(0, 97, (2, 12))
    fresh, _ = run_chunks(model, doc, [6, 6])
    # the lanes first read something else, then the document starts with reset=True
    _, state = run_chunks(model, torch.randint(0, 97, (2, 18)), [9, 9])
    reset = torch.tensor([True, True])
    a, state = model(doc[:, :6], state, reset)
    b, _ = model(doc[:, 6:], state)
    assert (torch.cat([a, b], 1) - fresh).abs().max() < 1e-12


def test_reset_only_touches_flagged_lanes():
    model = make(n_mem=2, kv_window=16)
    _, state = model(torch.randint(0, 97, (3, 10)))
    tokens = torch.randint(0, 97, (3, 5))
    reset = torch.tensor([False, True, False])
    out_reset, _ = model(tokens, state, reset)
    out_keep, _ = model(tokens, state)
    assert torch.equal(out_reset[[0, 2]], out_keep[[0, 2]])
    assert not torch.allclose(out_reset[1], out_keep[1])
    fresh, _ = model(tokens[1:2])
    assert (out_reset[1] - fresh[0]).abs().max() < 1e-12


@pytest.mark.parametrize("n_mem", [0, 2])
def test_lanes_never_influence_each_other(n_mem):
    model = make(dtype=torch.float32, n_mem=n_mem, kv_window=8)
    a = torch.randint(0, 97, (3, 3, 9))  # (chunks, lanes, T)
    b = a.clone()
    b[:, 1] = torch.randint(0, 97, (3, 9))  # lane 1 reads other tokens in every chunk
    sa = sb = None
    for t in range(3):
        la, sa = model(a[t], sa)
        lb, sb = model(b[t], sb)
        assert torch.equal(la[0], lb[0]), f"lane 0 changed in chunk {t}"
        assert torch.equal(la[2], lb[2])
        assert not torch.equal(la[1], lb[1])


@pytest.mark.parametrize("bptt", [1, 2, 3])
@pytest.mark.parametrize("layers", ["MA", "AA", "DA"])
def test_gradient_depth_is_bptt_chunks(bptt, layers):
    # The loss of chunk t reaches the chunks of its BPTT window [t - bptt + 1, t] through the carried
    # memory and SSM (or delta rule) state, and nothing before it (KV caches never carry gradient).
    # gates half open: shut gates (the default) pass no gradient to the write slots until their
    # gate vectors move from zero
    model = make(n_mem=2, kv_window=8, bptt_chunks=bptt, layers=layers, mem_gate_init=0.0)
    embedded = []
    handle = model.embed.register_forward_hook(lambda m, a, out: embedded.append(out))
    state, losses = None, []
    for _ in range(2 * bptt + 1):
        logits, state = model(torch.randint(0, 97, (2, 6)), state)
        losses.append(logits.pow(2).mean())
    handle.remove()
    t = 2 * bptt - 1  # the last chunk of the second window [bptt, 2 * bptt - 1]
    for s in range(t + 1):
        (g,) = torch.autograd.grad(losses[t], embedded[s], retain_graph=True, allow_unused=True)
        reach = g is not None and g.abs().max() > 0
        assert reach == (s >= t - bptt + 1), f"loss of chunk {t} vs chunk {s}"


@pytest.mark.parametrize("mem_update", ["replace", "gated"])
def test_read_memory_comes_from_the_write_slots(mem_update):
    # attention-only, no KV cache: the only path from chunk 1 to chunk 2 is the memory
    M, T = 3, 5
    model = make(layers="AA", n_mem=M, kv_window=0, bptt_chunks=2, mem_update=mem_update,
                 mem_gate_init=0.0)
    captured = {}

    def hook(module, args, output):
        output[0].retain_grad()
        captured["x"] = output[0]
    handle = model.blocks[-1].register_forward_hook(hook)
    _, state = model(torch.randint(0, 97, (2, T)))
    handle.remove()
    x = captured["x"]                                    # (B, M + T + M, D) of chunk 1
    if mem_update == "replace":
        assert torch.equal(state.memory, x[:, M + T:])
    else:  # gates start half open: halfway from the initial memory to the normalized write
        written = model.mem_norm(x[:, M + T:])
        assert torch.allclose(state.memory, 0.5 * model.mem_init + 0.5 * written, atol=1e-12)
    logits, _ = model(torch.randint(0, 97, (2, T)), state)
    logits.pow(2).sum().backward()
    g = x.grad.abs().sum(dim=(0, 2))                     # (M + T + M,)
    assert (g[M + T:] > 0).all()
    assert (g[:M + T] == 0).all()


def test_state_round_trips_through_state_dict_and_lane_selection():
    model = make(n_mem=2, kv_window=8)
    tokens = torch.randint(0, 97, (3, 7))
    _, state = model(tokens)
    copy = model.init_state(3)
    copy.load_state_dict(state.state_dict())
    nxt = torch.randint(0, 97, (3, 4))
    assert torch.equal(model(nxt, state)[0], model(nxt, copy)[0])
    parts = RecurrentState.cat([state.select(slice(0, 1)), state.select(slice(1, 3))])
    assert torch.equal(model(nxt, parts)[0], model(nxt, state)[0])
    bad = model.init_state(2)
    with pytest.raises(ValueError, match="shape"):
        bad.load_state_dict(state.state_dict())


def test_loss_helper_masks_and_averages():
    model = make()
    tokens = torch.randint(0, 97, (2, 6))
    targets = torch.randint(0, 97, (2, 6))
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, :4] = True
    logits, _ = model(tokens)
    loss, _ = model(tokens, targets=targets, loss_mask=mask)
    ref = torch.nn.functional.cross_entropy(logits[0, :4], targets[0, :4])
    assert torch.allclose(loss, ref)


def test_size_and_flops_accounting():
    model = make(layers="MA", tied_embeddings=True)
    n = sum(p.numel() for p in model.parameters())
    assert model.num_params() == n
    assert model.num_params(non_embedding=True) == n - 97 * 32
    f = model.flops_per_token(64)
    assert 6 * model.num_params(non_embedding=True) < f < 50 * model.num_params()


@pytest.mark.parametrize("tied", [True, False])
def test_flops_count_the_blocks_over_the_memory_slots_and_the_head_once_a_token(tied):
    # the blocks run over [read memory | T tokens | write slots]; the head only over the T tokens
    T, M, W = 64, 4, 64
    model = make(layers="MA", n_mem=M, kv_window=W, tied_embeddings=tied)
    cfg = model.cfg
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2)
    S = T + 2 * M
    attention = 6 * 2 * 32 * ((S + 1) / 2 + W)
    H, P, N, L = cfg.mamba_heads, cfg.mamba_head_dim, cfg.d_state, cfg.ssd_chunk
    scan = 6 * H * (L * (N + P) + 3 * P * N)
    expected = (6 * blocks + attention + scan) * S / T + 6 * 97 * 32
    assert model.flops_per_token(T) == pytest.approx(expected, rel=1e-12)
    # without memory slots nothing is overhead
    plain = make(layers="MA", n_mem=0, kv_window=W, tied_embeddings=tied)
    attention0 = 6 * 2 * 32 * ((T + 1) / 2 + W)
    assert plain.flops_per_token(T) == pytest.approx(6 * blocks + attention0 + scan + 6 * 97 * 32,
                                                     rel=1e-12)


def test_bad_inputs_get_clear_errors():
    model = make()
    _, state = model(torch.randint(0, 97, (2, 4)))
    with pytest.raises(ValueError, match="lanes"):
        model(torch.randint(0, 97, (3, 4)), state)


def test_fast_paths_equal_reference_paths_on_cpu():
    # on CPU the fast paths are SDPA and the fused elephant MLP (the Triton SSD is CUDA-only);
    # two chunks in one BPTT window, so every parameter (the memory gates too) gets a gradient
    model = make(n_mem=2, kv_window=16, bptt_chunks=2)
    tokens = torch.randint(0, 97, (2, 2, 11))
    outs = {}
    for fast in (False, True):
        model.set_fast_paths(fast)
        model.zero_grad()
        state, loss = None, 0
        for c in range(2):
            logits, state = model(tokens[c], state)
            loss = loss + logits.pow(2).mean()
        loss.backward()
        outs[fast] = logits.detach(), [p.grad.clone() for p in model.parameters()]
    model.set_fast_paths(True)
    assert (outs[True][0] - outs[False][0]).abs().max() < 1e-12
    for a, b in zip(outs[True][1], outs[False][1]):
        assert (a - b).abs().max() < 1e-12


def test_closed_memory_gates_keep_memory_bit_for_bit_and_still_learn():
    # A gate under mem_gate_min is exactly zero: the memory passes any number of chunks unchanged,
    # whatever they hold. Its gradient is the sigmoid's, so the gate can learn to open.
    model = make(layers="MA", n_mem=2, kv_window=8, bptt_chunks=4)
    with torch.no_grad():
        model.mem_gate_bias.fill_(-6.0)                  # sigmoid(-6) = 0.0025 < 0.05
    state = None
    for _ in range(3):
        logits, state = model(torch.randint(0, 97, (2, 7)), state)
    start = model.mem_init.detach().expand(2, -1, -1)
    assert torch.equal(state.memory, start)
    assert (model.last_mem_gate == 0).all()
    logits, state = model(torch.randint(0, 97, (2, 7)), state)
    logits.pow(2).sum().backward()
    assert model.mem_gate_bias.grad.abs().min() > 0
    with torch.no_grad():
        model.mem_gate_bias.fill_(0.0)
    _, opened = model(torch.randint(0, 97, (2, 7)), state.detach())
    assert not torch.equal(opened.memory, state.memory)


def test_memory_config_is_validated():
    from elephant.config import ConfigError
    with pytest.raises(ConfigError, match="mem_update"):
        tiny(mem_update="sum").validate()
    with pytest.raises(ConfigError, match="mem_gate_min"):
        tiny(mem_gate_min=1.5).validate()


def test_memory_write_cost_is_charged_in_training_only():
    # mem_write_cost adds cost x mean gate per token to the training loss, pushing gates closed;
    # evaluation (eval mode, or reduction="none") reports the cross-entropy alone.
    tokens, targets = torch.randint(0, 97, (2, 6)), torch.randint(0, 97, (2, 6))
    free = make(n_mem=2, layers="AA", mem_gate_init=0.0)
    paid = make(n_mem=2, layers="AA", mem_write_cost=0.5, mem_gate_init=0.0)
    paid.load_state_dict(free.state_dict())
    ce = free(tokens, targets=targets, reduction="sum")[0]
    for model in (free, paid):
        model.train()
    loss = paid(tokens, targets=targets, reduction="sum")[0]
    gates = paid.last_mem_gate                              # half open at init: 0.5 each
    assert torch.allclose(loss, ce + 0.5 * gates.mean(-1).sum() * 6)
    loss.backward()
    assert (paid.mem_gate_bias.grad > 0).all()              # descending it closes the gates
    paid.eval()
    assert torch.equal(paid(tokens, targets=targets, reduction="sum")[0], ce)
    paid.train()
    nll = paid(tokens, targets=targets, reduction="none")[0]
    assert torch.allclose(nll.sum(), ce)


def run_windows(model, n: int, run_chunk, B: int, path: bool = True):
    """Truncated BPTT over windows of 2 chunks (a backward per window, then the state detached),
    the memory-only path tracked across them with `path` (not yet backpropagated): run_chunk(c,
    state) -> (loss, state) feeds chunk c. Returns the state after the last window."""
    state = model.init_state(B, dtype=torch.float64)
    if path:
        state = state.track_memory_path()
    part = 0.0
    for c in range(n):
        if c and c % 2 == 0:
            part.backward()
            part, state = 0.0, state.detach()
        loss, state = run_chunk(c, state)
        part = part + loss
    part.backward()
    return state


def test_memory_only_backprop_equals_its_reference_and_reaches_past_the_window():
    # Truncated BPTT over windows of 2 chunks, with the memory path kept across the detaches
    # (backward per window, then backward_memory_path) must give, in every parameter, the sum over
    # windows w of the gradient of window w's loss through (a) its own chunks in full and (b) the
    # memory updates of all earlier chunks with their written slots detached, computed here from
    # scratch for each window.
    model = make(layers="MA", n_mem=2, kv_window=4, bptt_chunks=2, mem_gate_init=0.0).train()
    torch.manual_seed(1)
    B, T, n = 2, 5, 6
    tokens, targets = torch.randint(0, 97, (B, T * n)), torch.randint(0, 97, (B, T * n))
    chunk = lambda c: (tokens[:, c * T:(c + 1) * T], targets[:, c * T:(c + 1) * T])

    def feed(c, state):
        x, y = chunk(c)
        return model(x, state, torch.ones(B, dtype=torch.bool) if c == 0 else None, targets=y,
                     reduction="sum")

    def run_chunk(c, state):
        if c and c % 2 == 0:   # just detached: the next chunks read the memory as a leaf
            assert state.memory.requires_grad and state.memory_path.requires_grad
        loss, state = feed(c, state)
        assert torch.equal(state.memory, state.memory_path)   # the path changes no value
        return loss, state
    state = run_windows(model, n, run_chunk, B)
    assert state.backward_memory_path() == 2                  # two detaches carried a gradient
    got = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    update = model._memory_update
    model.cfg.bptt_chunks = n     # the reference cuts the activations itself
    for w in range(n // 2):
        state = model.init_state(B, dtype=torch.float64)
        for c in range(2 * w + 2):
            if c == 2 * w and c:   # entering window w: activations cut, the memory chain kept
                memory, state = state.memory, state.detach()
                state.memory = memory
            model._memory_update = (lambda r, u: update(r, u.detach())) if c < 2 * w else update
            x, y = chunk(c)
            loss, state = model(x, state, torch.ones(B, dtype=torch.bool) if c == 0 else None,
                                targets=y, reduction="sum")
            if c == 2 * w:
                window_loss = loss
            elif c > 2 * w:
                window_loss = window_loss + loss
        window_loss.backward()
    model._memory_update = update
    model.cfg.bptt_chunks = 2
    want = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)
    # the path is what carries the later windows' loss to the gates of the first chunks: without
    # it the gate parameters get less gradient
    model.zero_grad()
    run_windows(model, n, feed, B, path=False)
    assert not torch.allclose(model.mem_gate.grad, got["mem_gate"])


def test_compiled_chunk_gives_the_memory_path_gradients_of_the_eager_model():
    # compile_for("model") compiles `_chunk` (one autograd node per chunk, freed by its window's
    # backward); the detach and the memory-only path stay in forward, outside the graph, so
    # truncated windows with the path tracked give the eager model's gradients (traced here with
    # the aot_eager backend, float64), without a graph break
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch.manual_seed(1)
    B, T, n = 2, 5, 6
    tokens, targets = torch.randint(0, 97, (B, T * n)), torch.randint(0, 97, (B, T * n))
    starts = torch.zeros(B, T * n, dtype=torch.bool)
    starts[0, 7] = starts[1, 18] = True                      # documents starting inside chunks
    grads = []
    for compiled in (False, True):
        model = make(layers="MA", n_mem=2, kv_window=4, bptt_chunks=2, mem_gate_init=0.0).train()
        torch._dynamo.reset()
        counters.clear()
        if compiled:
            model.compile_for("model", backend="aot_eager")
        def run_chunk(c, state):
            sl = slice(c * T, (c + 1) * T)
            s = starts[:, sl].clone()
            s[:, 0] |= c == 0
            return model(tokens[:, sl], state, targets=targets[:, sl], reduction="sum", starts=s)
        state = run_windows(model, n, run_chunk, B)
        assert state.backward_memory_path() == 2
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
        if compiled:
            assert not counters["graph_break"] and counters["stats"]["unique_graphs"] >= 1
    assert set(grads[0]) == set(grads[1])
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-9, atol=1e-12, msg=k)


def test_compile_for_leaves_room_for_every_graph_variant():
    # a packed run's chunk step has up to 8 graphs in training alone (first / later chunk of a
    # window, with or without starts, prefix computed or carried, varlen room or not), evaluation
    # more: past dynamo's limit the rest would run uncompiled, silently
    import torch._dynamo
    from elephant.compile import COMPILE_VARIANTS, _limit_name
    config = torch._dynamo.config
    name = _limit_name(config)
    saved = getattr(config, name)
    try:   # (monkeypatch's undo deletes a dynamo config entry, so by hand)
        setattr(config, name, 8)
        make(layers="MA").compile_for("blocks", backend="aot_eager")
        assert COMPILE_VARIANTS >= 32 and getattr(config, name) == COMPILE_VARIANTS
    finally:
        setattr(config, name, saved)


def test_compile_for_turns_inductor_padding_off(monkeypatch):
    # inductor's comprehensive padding widened the Mamba in-projection's output rows (2,192 ->
    # 2,240 columns) and then copied the conv's slice back to the layout its kernel was traced
    # with, forward and backward: every compile of the chunk step (blocks, the chunk, the CUDA
    # graphs' form) turns it off, and torch.compile accepts the options as given
    from elephant.model import compile_kwargs
    seen = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: seen.append(kw) or real(fn, **kw))
    model = make(layers="MA")
    model.compile_for("graphs", backend="inductor")
    graphs = [kw for kw in seen if kw["options"].get("triton.cudagraphs")]
    assert len(seen) == 4 and len(graphs) == 2          # _chunk and init_prefix, plain and graphs
    assert all(kw["options"]["comprehensive_padding"] is False and kw["dynamic"] is False
               for kw in seen)
    seen.clear()
    make(layers="MA").compile_for("blocks", backend="inductor")
    assert len(seen) == 2 and all(kw["options"] == {"comprehensive_padding": False} for kw in seen)
    assert compile_kwargs("aot_eager", True) == dict(dynamic=False, backend="aot_eager",
                                                     mode="reduce-overhead")


def test_a_carried_state_does_not_recompile_the_compiled_chunk():
    # the state a chunk hands on has a fresh state's strides (the conv state is not left a view of
    # the conv's window), so the compiled chunk compiles once per kind of chunk (the first of a
    # window, with a state that needs no gradient, and the later ones), not again for the first
    # chunk after a carried state: steps 2 and 3 add no graph to those of step 1
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = make(layers="MA", n_mem=2, kv_window=4, bptt_chunks=2).train()
    model.compile_for("model", backend="aot_eager")
    gen = torch.Generator().manual_seed(5)
    B, T = 2, 5
    state = model.init_state(B)
    graphs = []
    for step in range(3):
        loss = 0.0
        for _ in range(2):
            tokens = torch.randint(0, 97, (B, T + 1), generator=gen)
            nll, state = model(tokens[:, :-1], state, torch.zeros(B, dtype=torch.bool),
                               targets=tokens[:, 1:], reduction="sum")
            loss = loss + nll
        loss.backward()
        state = state.detach()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == 2 and graphs[1:] == [2, 2], graphs


def test_static_carry_holds_the_state_in_fixed_buffers_and_copies_only_what_is_elsewhere():
    # StaticCarry (the trainer's CUDA-graph steps): the state a step starts from and the one it
    # ends with go into the same buffers, marked as static inputs of compiled functions; a state
    # already in them (or a detached view of one) is not copied again, and the values and the
    # next chunk's output are those of the state given
    from elephant.state import StaticCarry
    model = make(n_mem=2, kv_window=4)
    tokens = torch.randint(0, 97, (2, 12))
    _, state = model(tokens[:, :6])
    carry = StaticCarry()
    held = carry.take(state)
    buffers = list(held.tensors().values())
    assert all(getattr(b, "_dynamo_static_input_type", None) == "unguarded" for b in buffers)
    for mine, theirs in zip(buffers, state.tensors().values()):
        assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr()
    assert held.chunks == state.chunks and held.prefix is None and held.memory_path is None
    want, after = model(tokens[:, 6:], state)
    got, _ = model(tokens[:, 6:], held)
    assert torch.equal(got, want)
    again = carry.take(held.detach())        # already there: the same buffers, nothing copied
    assert [t.data_ptr() for t in again.tensors().values()] == [b.data_ptr() for b in buffers]
    kept = carry.take(after)                 # a step's last state: into the same buffers
    assert [t.data_ptr() for t in kept.tensors().values()] == [b.data_ptr() for b in buffers]
    for mine, theirs in zip(kept.tensors().values(), after.tensors().values()):
        assert torch.equal(mine, theirs)
    with pytest.raises(ValueError, match="more tensors"):
        state.with_tensors(buffers + [buffers[0]])
    other = make(n_mem=2, kv_window=4, layers="AA").init_state(2)   # another structure: new buffers
    assert list(carry.take(other).tensors()) == list(other.tensors())


def test_kv_window_dtype_follows_kv_dtype_and_holds_the_same_keys():
    # init_state(kv_dtype=): the attention window in the dtype attention computes in (bf16 under
    # autocast); the keys a chunk leaves there are the ones it made, cast once
    model = make(kv_window=4, dtype=torch.float32)
    state = model.init_state(2, kv_dtype=torch.bfloat16)
    assert all(c.k.dtype == c.v.dtype == torch.bfloat16 for c in state.kv if c is not None)
    assert state.ssm[0].dtype == torch.float32 and state.pos.dtype == torch.long
    tokens = torch.randint(0, 97, (2, 6))
    _, wide = model(tokens, model.init_state(2))
    _, narrow = model(tokens, state)
    for a, b in zip(wide.kv, narrow.kv):
        if a is not None:
            assert b.k.dtype == torch.bfloat16 and torch.equal(a.k.to(torch.bfloat16), b.k)


def test_static_carry_copies_another_view_of_its_own_buffer_safely():
    # a state whose tensor is another view of a carry buffer (the window's keys with the head and
    # slot axes swapped: the same shape, 4 heads and 4 slots, other strides) gets that view's
    # values, read before the buffer is overwritten; the buffer itself is left as it is
    from elephant.state import StaticCarry
    model = make(kv_window=4)
    _, state = model(torch.randint(0, 97, (3, 6)))
    carry = StaticCarry()
    held = carry.take(state)
    swapped = held.with_tensors(list(held.tensors().values()))
    i = next(i for i, c in enumerate(held.kv) if c is not None)
    swapped.kv[i] = held.kv[i].map(lambda t: t.transpose(1, 2) if t.dim() == 4 else t)
    assert swapped.kv[i].k.data_ptr() == held.kv[i].k.data_ptr()
    want = {k: t.clone() for k, t in swapped.tensors().items()}
    again = carry.take(swapped)
    for k, t in again.tensors().items():
        assert torch.equal(t, want[k]), k
    assert not torch.equal(want[f"kv.{i}.k"], state.kv[i].k)   # the swap changed the values


@pytest.mark.parametrize("update", ["gated", "replace"])
def test_residual_autocast_keeps_the_stream_in_autocasts_dtype(update):
    # model.residual "autocast": under autocast every block reads and returns the residual stream
    # in autocast's dtype (bf16 here; "float32": the embeddings' float32), while the carried
    # memory keeps its float32 from chunk to chunk (a changed state dtype would be a new compile of
    # a compiled chunk); the two streams give close losses; outside autocast the option changes
    # nothing, bit for bit
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    seen, losses = {}, {}
    for residual in ("float32", "autocast"):
        m = make(dtype=torch.float32, n_mem=2, kv_window=8, mem_update=update, residual=residual)
        dtypes = []
        hooks = [b.register_forward_hook(lambda mod, args, out: dtypes.append(out[0].dtype))
                 for b in m.blocks]
        state = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for part in tokens.split(12, dim=1):
                logits, state = m(part, state)
                assert state.memory.dtype == torch.float32
        for h in hooks:
            h.remove()
        seen[residual] = set(dtypes)
        losses[residual] = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                             tokens[:, 12:].flatten())
        with torch.no_grad():
            plain = m(tokens)[0]
        losses[residual, "plain"] = plain
    assert seen == {"float32": {torch.float32}, "autocast": {torch.bfloat16}}
    assert abs(losses["float32"] - losses["autocast"]) < 0.05
    assert torch.equal(losses["float32", "plain"], losses["autocast", "plain"])


def test_unknown_residual_dtype_is_named():
    from elephant.config import ConfigError
    with pytest.raises(ConfigError, match="model.residual: expected one of float32, autocast"):
        tiny(residual="bf16").validate()


def test_attention_reading_the_stack_input_is_the_plain_model_at_zero_gain():
    # attn_x0 adds gain * rmsnorm(stack input) to each attention layer's input, and nothing else:
    # with every gain at 0 it is the plain model with the same weights (memory, window and kept
    # tokens on, so the memory positions' input is covered), and with the gains at their initial
    # 1 it is not; only attention layers have a gain, and the optimizers put it with Adam's
    from elephant.optim.build import assign_parameters
    kw = dict(layers="MAMA", n_mem=2, kv_window=6, kv_keep=3, mem_rotary="free")
    plain, x0 = make(**kw), make(attn_x0=True, **kw)
    missing, unexpected = x0.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(missing) == ["blocks.1.x0_gain", "blocks.3.x0_gain"] and not unexpected
    tokens = torch.randint(0, 97, (2, 21))
    want, _ = run_chunks(plain, tokens, [7, 7, 7])
    on, _ = run_chunks(x0, tokens, [7, 7, 7])
    assert (on - want).abs().max() > 1e-3
    with torch.no_grad():
        for block in x0.blocks[1::2]:
            block.x0_gain.zero_()
    off, _ = run_chunks(x0, tokens, [7, 7, 7])
    assert torch.equal(off, want)
    roles = {name: role for name, _, role, _ in assign_parameters(x0)}
    assert roles["blocks.1.x0_gain"] == roles["blocks.3.x0_gain"] == "other"


def test_the_normalized_sum_keeps_the_attention_input_at_the_plain_models_scale():
    # attn_x0_norm: the attention reads norm1(rmsnorm(x) + g * x0); at gain 0 that is the plain
    # model (up to the second norm's eps), and at its initial gain 1 every position's
    # input has RMS 1 before norm1's weight, where the plain sum's is larger
    from elephant.config import ConfigError
    kw = dict(layers="MAMA", n_mem=2, kv_window=6, kv_keep=3, mem_rotary="free")
    plain, normed, summed = (make(**kw), make(attn_x0=True, attn_x0_norm=True, **kw),
                             make(attn_x0=True, **kw))
    normed.load_state_dict(plain.state_dict(), strict=False)
    summed.load_state_dict(normed.state_dict())
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    x0 = normed.stack_input(torch.randn(2, 9, 32, dtype=torch.float64))
    block_n, block_s = normed.blocks[1], summed.blocks[1]
    rms = lambda t: t.pow(2).mean(-1).sqrt()   # noqa: E731  (norm1's weight starts at 1)
    assert torch.allclose(rms(block_n.mixer_input(x, x0)), torch.ones(2, 9, dtype=torch.float64))
    assert rms(block_s.mixer_input(x, x0)).mean() > 1.2
    tokens = torch.randint(0, 97, (2, 21))
    want, _ = run_chunks(plain, tokens, [7, 7, 7])
    with torch.no_grad():
        for block in normed.blocks[1::2]:
            block.x0_gain.zero_()
    off, _ = run_chunks(normed, tokens, [7, 7, 7])
    torch.testing.assert_close(off, want, rtol=1e-4, atol=1e-4)   # the second norm's eps
    with pytest.raises(ConfigError, match="model.attn_x0_norm .* set model.attn_x0"):
        tiny(attn_x0_norm=True).validate()


def test_the_gain_of_the_stack_input_learns_and_restarts_at_its_init():
    model = make(layers="MA", attn_x0=True, attn_x0_init=0.25).train()
    tokens = torch.randint(0, 97, (2, 12))
    loss, _ = model(tokens[:, :-1], targets=tokens[:, 1:])
    loss.backward()
    gain = model.blocks[1].x0_gain
    assert gain.grad is not None and gain.grad.abs().sum() > 0
    with torch.no_grad():
        gain.mul_(3.0)
    model.reset_parameters()
    assert torch.equal(gain, torch.full_like(gain, 0.25))


@pytest.mark.parametrize("kind", ["channel", "layer", "fixed"])
def test_the_gain_kinds_of_the_stack_input_compute_the_same_model_at_init(kind):
    # attn_x0_gain: a per-channel, per-layer or fixed gain all start at attn_x0_init and compute
    # the same model from the same weights; the fixed one is a buffer (saved, loaded, never given a
    # gradient nor an optimizer), the learned ones get a gradient
    from elephant.optim.build import assign_parameters
    kw = dict(layers="MAMA", n_mem=2, kv_window=6, kv_keep=3, mem_rotary="free", attn_x0=True,
              attn_x0_init=0.25)
    channel, model = make(**kw), make(attn_x0_gain=kind, **kw)
    missing, unexpected = model.load_state_dict(
        {k: v for k, v in channel.state_dict().items() if not k.endswith("x0_gain")}, strict=False)
    assert sorted(missing) == ["blocks.1.x0_gain", "blocks.3.x0_gain"] and not unexpected
    tokens = torch.randint(0, 97, (2, 21))
    want, _ = run_chunks(channel, tokens, [7, 7, 7])
    got, _ = run_chunks(model, tokens, [7, 7, 7])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    gain = model.blocks[1].x0_gain
    assert gain.shape == ((1,) if kind == "layer" else (32,))
    assert torch.equal(gain, torch.full_like(gain, 0.25))
    names = {name for name, *_ in assign_parameters(model)}
    assert ("blocks.1.x0_gain" in names) == (kind != "fixed")
    assert "blocks.1.x0_gain" in model.state_dict()
    loss, _ = model(tokens[:, :-1], targets=tokens[:, 1:])
    loss.backward()
    assert (gain.grad is None) == (kind == "fixed") and gain.requires_grad == (kind != "fixed")
    with torch.no_grad():   # a fixed gain is what the weights compute: a checkpoint carries it
        gain.fill_(0.5)
    again = make(attn_x0_gain=kind, **kw)
    again.load_state_dict(model.state_dict())
    assert torch.equal(again.blocks[1].x0_gain, torch.full_like(gain, 0.5))
    with pytest.raises(Exception, match="model.attn_x0_gain: expected one of channel, layer, fixed"):
        tiny(attn_x0_gain="scalar").validate()
