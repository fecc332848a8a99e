"""The gated delta rule mixer (`D` layers, elephant/layers/delta.py): the chunked rule equals the
token-by-token recurrence (fp64, initial state, segments, gradients), the mixer keeps the chunk
contract (carried conv state and S: chunks == one pass, packed segments == each alone, the token
step == forward), and a model with D layers trains, routes its parameters to the right optimizer,
counts its FLOPs and ablates D's state. The model-level contract tests (chunked == whole, packed ==
alone, initial memory, generation) include D in their parametrizations in test_model.py,
test_packing.py and test_generate.py."""
import pytest
import torch
import torch.nn.functional as F

from elephant.config import ConfigError, ModelConfig
from elephant.layers import delta
from elephant.layers.delta import (GatedDeltaNet, delta_rule_chunked, delta_rule_recurrent,
                                   delta_rule_step)
from tiny_lm import packed_and_alone, tiny_lm

V = 97


def rule_inputs(b=2, l=29, h=3, dk=8, dv=12, seed=0, dtype=torch.float64, decay=0.5):
    """q (scaled), k unit-norm, v, beta in (0, 1), g = log alpha in (-decay, 0], a state."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)   # noqa: E731
    q = F.normalize(rand(b, l, h, dk), dim=-1) * dk ** -0.5
    k = F.normalize(rand(b, l, h, dk), dim=-1)
    beta = torch.rand(b, l, h, generator=gen, dtype=dtype)
    g = -decay * torch.rand(b, l, h, generator=gen, dtype=dtype)
    return q, k, rand(b, l, h, dv), beta, g, rand(b, h, dk, dv)


def segments(b: int, l: int, bounds) -> torch.Tensor:
    seg = torch.zeros(b, l, dtype=torch.long)
    for a in bounds:
        seg[:, a:] += 1
    return seg


@pytest.mark.parametrize("chunk", [1, 4, 8, 64])
def test_chunked_rule_equals_recurrence_with_its_gradients(chunk):
    # 29 tokens: a partial last block for every block length but 1 (and one partial block of 64)
    inputs = [t.requires_grad_() for t in rule_inputs()]
    o_ref, s_ref = delta_rule_recurrent(*inputs)
    dy, ds = torch.randn_like(o_ref), torch.randn_like(s_ref)
    want = torch.autograd.grad((o_ref * dy).sum() + (s_ref * ds).sum(), inputs)
    o, s = delta_rule_chunked(*inputs, chunk_size=chunk)
    got = torch.autograd.grad((o * dy).sum() + (s * ds).sum(), inputs)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=1e-12, atol=1e-12)
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a, b_, rtol=1e-10, atol=1e-11)


def test_recurrence_is_the_delta_rule():
    # one token per head by hand: S' = alpha (S - beta k (k^T S)) + beta k v^T, o = S'^T q; with
    # alpha = beta = 1 a read with k returns v exactly (the old value under k is replaced)
    q, k, v, beta, g, s = rule_inputs(l=1)
    q, k, v, beta, g = (t[:, 0] for t in (q, k, v, beta, g))
    o, new = delta_rule_step(q, k, v, beta, g, s)
    a, bt = torch.exp(g)[..., None, None], beta[..., None, None]
    want = a * (s - bt * k[..., None] * torch.einsum("bhk,bhkv->bhv", k, s)[:, :, None]) \
        + bt * k[..., None] * v[:, :, None]
    torch.testing.assert_close(new, want, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(o, torch.einsum("bhk,bhkv->bhv", q, want), rtol=1e-14, atol=1e-14)
    _, full = delta_rule_step(q, k, v, torch.ones_like(beta), torch.zeros_like(g), s)
    torch.testing.assert_close(torch.einsum("bhk,bhkv->bhv", k, full), v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_init", [False, True])
def test_chunked_rule_restarts_at_each_segment_as_the_recurrence(with_init):
    # segments of 2, 1, 8, 1, 1, 13 and 3 tokens (lane 1 with one more boundary), blocks of 8 and
    # 4: boundaries inside blocks, at a block's start and two in a row; each segment after the
    # first equals the rule run alone from zero (or from S0), the first from the carried state
    q, k, v, beta, g, s0 = rule_inputs()
    seg = segments(2, 29, [2, 3, 11, 12, 13, 26])
    seg[1, 5:] += 1
    init = torch.randn(3, 8, 12, dtype=torch.float64) if with_init else None
    o_ref, s_ref = delta_rule_recurrent(q, k, v, beta, g, s0, seg, init)
    for chunk in (4, 8):
        o, s = delta_rule_chunked(q, k, v, beta, g, s0, chunk, seg, init)
        torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s, s_ref, rtol=1e-12, atol=1e-12)
    bounds = [0, 2, 3, 11, 12, 13, 26, 29]
    for a, b_ in zip(bounds[:-1], bounds[1:]):
        start = s0[:1] if a == 0 else (torch.zeros_like(s0[:1]) if init is None else init[None])
        alone, end = delta_rule_recurrent(*(t[:1, a:b_] for t in (q, k, v, beta, g)), start)
        torch.testing.assert_close(o_ref[:1, a:b_], alone, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s_ref[:1], end, rtol=1e-12, atol=1e-12)


def test_chunked_rule_compiles_as_one_graph():
    # shape-static: torch.compile traces it whole (fullgraph: no graph break), and it computes
    # what the eager form does
    inputs = rule_inputs(l=20)
    compiled = torch.compile(delta_rule_chunked, backend="aot_eager", fullgraph=True, dynamic=False)
    got = compiled(*inputs, chunk_size=8)
    want = delta_rule_chunked(*inputs, chunk_size=8)
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a, b_, rtol=1e-12, atol=1e-12)


def test_backend_switch_names_bad_choices_and_a_missing_fla_core(monkeypatch):
    import builtins
    with pytest.raises(ValueError, match="ELEPHANT_DELTA / delta.set_backend: expected one of torch, fla"):
        delta.set_backend("cuda")
    real = builtins.__import__

    def no_fla(name, *args, **kwargs):
        if name.startswith("fla"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_fla)
    before = delta.get_backend()
    with pytest.raises(RuntimeError, match="needs fla-core"):
        delta.set_backend("fla")
    assert delta.get_backend() == before   # a failed switch leaves the path as it was
    monkeypatch.setattr(delta, "_backend", "fla")
    # opted in, a CPU input still takes the chunked form, which needs no fla-core
    inputs = rule_inputs(l=5)
    got = delta.delta_rule(*inputs, chunk_size=4)
    want = delta_rule_chunked(*inputs, chunk_size=4)
    assert all(torch.equal(a, b_) for a, b_ in zip(got, want))


def test_bad_shapes_are_named():
    q, k, v, beta, g, s0 = rule_inputs()
    with pytest.raises(ValueError, match="initial_state must be"):
        delta_rule_chunked(q, k, v, beta, g, s0[:, :, :4])
    with pytest.raises(ValueError, match="segment_init .* goes with seg"):
        delta_rule_chunked(q, k, v, beta, g, s0, 8, None, s0[0])


# ------------------------------------------------------------------------------------ the mixer
def cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=32, n_heads=4, layers="D", d_mlp=0, d_conv=4, ssd_chunk=8)
    return ModelConfig(**(base | kw))


def mixer(seed=0, **kw) -> GatedDeltaNet:
    torch.manual_seed(seed)
    m = GatedDeltaNet(cfg(**kw)).double()
    with torch.no_grad():  # larger than the init so that every part of the mixer matters
        m.in_proj.weight.normal_(0, 0.3)
        m.out_proj.weight.normal_(0, 0.3)
        m.conv1d.bias.normal_()
        m.norm.weight.uniform_(0.5, 1.5)
    return m


def random_state(m: GatedDeltaNet, batch: int, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t.shape, generator=gen, dtype=torch.float64)
                 for t in m.init_state(batch, dtype=torch.float64))


def test_layer_shapes_and_state():
    m = mixer()
    H, dk, dv = 4, 8, 12   # n_heads, d_model / n_heads, 1.5 x that
    assert (m.heads, m.key_dim, m.value_dim) == (H, dk, dv) and m.conv_dim == H * (2 * dk + dv)
    assert m.in_proj.weight.shape == (m.conv_dim + H * dv + 2 * H, 32)
    assert m.out_proj.weight.shape == (32, H * dv)
    conv, s = m.init_state(3, dtype=torch.bfloat16)
    assert conv.shape == (3, m.conv_dim, 3) and conv.dtype == torch.bfloat16
    assert s.shape == (3, H, dk, dv) and s.dtype == torch.float32


@pytest.mark.parametrize("lengths", [[1, 3, 17, 9], [30], [8, 8, 14]])
def test_layer_over_chunks_with_carried_state_equals_whole_sequence(lengths):
    m = mixer()
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    conv0, s0 = random_state(m, 2)
    want, conv_w, s_w = m(x, conv0, s0)
    ys, conv, s, a = [], conv0, s0, 0
    for n in lengths:
        y, conv, s = m(x[:, a:a + n], conv, s)
        ys.append(y)
        a += n
    torch.testing.assert_close(torch.cat(ys, 1), want, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(conv, conv_w, rtol=1e-12, atol=1e-12)   # (matmul rounding)
    torch.testing.assert_close(s, s_w, rtol=1e-11, atol=1e-11)
    # and the token step, one token at a time
    steps, conv, s = [], conv0, s0
    for t in range(30):
        y, conv, s = m.step(x[:, t], conv, s)
        steps.append(y)
    torch.testing.assert_close(torch.stack(steps, 1), want, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(s, s_w, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("with_init", [False, True])
def test_layer_restarts_conv_and_state_at_each_boundary(with_init):
    # each segment of a packed row equals the mixer run on that segment alone: segment 0 from the
    # carried state, later ones from zero (or from `init`: conv tail and S0)
    m = mixer()
    L = 29
    x = torch.randn(2, L, 32, dtype=torch.float64)
    conv0, s0 = random_state(m, 2)
    bounds = [0, 2, 3, 11, 12, 13, 26, L]
    init = None
    if with_init:
        init = (torch.randn(m.conv_dim, 3, dtype=torch.float64),
                torch.randn(m.heads, m.key_dim, m.value_dim, dtype=torch.float64))
    (y, conv, s), alone = packed_and_alone(m, x, conv0, s0, bounds, init)
    for i, (a, b_) in enumerate(zip(bounds[:-1], bounds[1:])):
        torch.testing.assert_close(y[:, a:b_], alone[i][0], rtol=1e-11, atol=1e-11)
    _, conv_i, s_i = alone[-1]
    torch.testing.assert_close(conv, conv_i, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, s_i, rtol=1e-11, atol=1e-11)


def test_gradients_reach_the_carried_state():
    m = mixer()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    conv0, s0 = (t.requires_grad_() for t in random_state(m, 2))
    y, _, _ = m(x, conv0, s0)
    y.pow(2).sum().backward()
    assert conv0.grad.abs().sum() > 0 and s0.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


def test_config_names_bad_delta_settings():
    with pytest.raises(ConfigError, match="model.layers: .*'D' \\(gated delta rule\\)"):
        cfg(layers="MDX").validate()
    with pytest.raises(ConfigError, match="model.delta_expand_v: .* whole value size"):
        cfg(delta_expand_v=1.3).validate()
    with pytest.raises(ConfigError, match="model.delta_expand_v: expected a value > 0"):
        cfg(delta_expand_v=0.0).validate()
    assert cfg(delta_expand_v=2.0).delta_value_dim == 16


def test_a_delta_layer_has_about_a_mamba_layers_parameters():
    from elephant.layers.mamba import Mamba2
    c = ModelConfig(d_model=512)
    count = lambda m: sum(p.numel() for p in m.parameters())   # noqa: E731
    mamba, delta_ = count(Mamba2(c)), count(GatedDeltaNet(c))
    assert (mamba, delta_) == (1_653_424, 1_721_872)      # 1.04x at the default delta_expand_v


# ------------------------------------------------------------------------------------ the model
def test_model_with_delta_layers_trains_and_routes_each_parameter():
    # a few optimizer steps on a tiny batch lower the loss (two chunks with carried state,
    # backpropagated together); D's projections go to Muon, its decay, conv and norm to Adam
    from elephant.config import OptimConfig
    from elephant.optim.build import assign_parameters, build_optimizers
    model = tiny_lm(layers="MDAD", n_mem=2, kv_window=8, bptt_chunks=2).float().train()
    roles = {name: role for name, _, role, _ in assign_parameters(model)}
    for i in (1, 3):
        p = f"blocks.{i}.mixer."
        assert roles[p + "in_proj.weight"] == roles[p + "out_proj.weight"] == "muon"
        for n in ("A_log", "dt_bias", "conv1d.weight", "conv1d.bias", "norm.weight"):
            assert roles[p + n] == "other", n
    opt = build_optimizers(model, OptimConfig(warmup_steps=0, muon_lr=0.02, adam_lr=0.01))
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (2, 2, 13), generator=gen)
    losses = []
    for step in range(8):
        opt.set_step(step, 8)
        state, loss = None, 0.0
        for c in range(2):
            nll, state = model(tokens[c, :, :-1], state, targets=tokens[c, :, 1:])
            loss = loss + nll
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_reset_lane_forgets_previous_document_with_delta_layers():
    model = tiny_lm(layers="MDAD", n_mem=3, kv_window=16)
    doc = torch.randint(0, V, (2, 12))
    fresh, s = model(doc[:, :6])
    fresh2, _ = model(doc[:, 6:], s)
    _, state = model(torch.randint(0, V, (2, 18)))
    a, state = model(doc[:, :6], state, torch.tensor([True, True]))
    b, _ = model(doc[:, 6:], state)
    torch.testing.assert_close(torch.cat([a, b], 1), torch.cat([fresh, fresh2], 1),
                               rtol=1e-12, atol=1e-12)


def test_flops_count_the_delta_rule():
    T = 64
    with_d, with_m = tiny_lm(layers="DA"), tiny_lm(layers="MA")
    c = with_d.cfg
    blocks = lambda m: sum(p.numel() for n, p in m.named_parameters()   # noqa: E731
                           if n.startswith("blocks.") and p.dim() == 2)
    K, Vd, L = c.head_dim, c.delta_value_dim, c.ssd_chunk
    rule = 6 * c.n_heads * (L * (2 * K + Vd + (K + Vd) / 2) + 3 * K * Vd)
    attention = 6 * 2 * 32 * (T + 1) / 2
    want = 6 * blocks(with_d) + attention + rule + 6 * V * 32
    assert with_d.flops_per_token(T) == pytest.approx(want, rel=1e-12)
    assert with_d.flops_per_token(T) != with_m.flops_per_token(T)


def test_recall_and_eval_drop_the_delta_state():
    # "delta" zeroes the D layers' conv state and S alone; "ssm" every recurrent layer's (M and D);
    # recall's ablation and eval.py --drop go through the same drop_parts
    from elephant.evaluate import dropped
    from elephant.recall import ablate
    from elephant.state import drop_parts, parse_parts
    model = tiny_lm(layers="MDAD", kv_window=8)
    _, state = model(torch.randint(0, V, (2, 9)))
    d = ablate(model, state, "delta")
    s = ablate(model, state, "ssm")
    assert parse_parts("delta,window") == ("window", "delta")
    by_eval = dropped(model, state, parse_parts("delta"))
    assert all(torch.equal(a, b_) for a, b_ in zip(by_eval.tensors().values(), d.tensors().values()))
    with pytest.raises(ValueError, match="'delta' needs the model's layers"):
        drop_parts(state, ("delta",))
    for i, kind in enumerate("MDAD"):
        for name in ("conv", "ssm"):
            t, td, ts = (getattr(x, name)[i] for x in (state, d, s))
            if kind == "A":
                assert t is td is ts is None
                continue
            assert t.abs().sum() > 0 and not ts.any()
            assert (not td.any()) if kind == "D" else torch.equal(td, t)


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_on_cuda_equals_the_fp64_reference(dtype):
    # the Triton conv (short_conv's CUDA path) and the chunked rule in float32 on CUDA, packed
    # segments with the initial prefix included, against the same layer in float64 on the CPU
    m = mixer(d_model=128, n_heads=2, ssd_chunk=64)
    x = torch.randn(2, 200, 128, dtype=torch.float64)
    conv0, s0 = random_state(m, 2)
    seg = segments(2, 200, [70, 150])
    init = (torch.randn(m.conv_dim, 3, dtype=torch.float64),
            torch.randn(m.heads, m.key_dim, m.value_dim, dtype=torch.float64))
    want = m(x, conv0, s0, seg=seg, init=init)
    mc = m.to("cuda", dtype)
    got = mc(x.to("cuda", dtype), conv0.to("cuda", dtype), s0.float().cuda(), seg=seg.cuda(),
             init=tuple(t.to("cuda", dtype) for t in init))
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    for a, b_ in zip(got, want):
        rel = (a.double().cpu() - b_).norm() / b_.norm()
        assert rel < tol


@pytest.mark.gpu
def test_fla_kernel_equals_the_chunked_rule():
    # fla-core's chunk_gated_delta_rule (opt-in, delta.set_backend) against the chunked rule in
    # float32: the same outputs and final state, gradients included, bf16 inputs
    pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core is an optional fast path")
    q, k, v, beta, g, s0 = (t.float().cuda() for t in rule_inputs(b=2, l=300, h=4, dk=64, dv=96))
    q, k, v = (t.bfloat16().float() for t in (q, k, v))   # what the kernel reads
    inputs = [t.requires_grad_() for t in (q, k, v, beta, g, s0)]
    o_ref, s_ref = delta_rule_chunked(*inputs, chunk_size=64)
    dy, ds = torch.randn_like(o_ref), torch.randn_like(s_ref)
    want = torch.autograd.grad((o_ref * dy).sum() + (s_ref * ds).sum(), inputs)
    o, s = delta.delta_rule_fla(*inputs)
    got = torch.autograd.grad((o.float() * dy).sum() + (s * ds).sum(), inputs)
    rel = lambda a, b_: ((a.float() - b_).norm() / b_.norm()).item()   # noqa: E731
    assert rel(o, o_ref) < 2e-2 and rel(s, s_ref) < 2e-2
    for a, b_ in zip(got, want):
        assert rel(a, b_) < 5e-2
    before = delta.get_backend()
    delta.set_backend("fla")
    try:
        o2, _ = delta.delta_rule(*inputs)
    finally:
        delta.set_backend(before)
    assert torch.equal(o2, o)
