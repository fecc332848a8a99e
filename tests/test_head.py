"""The blocked linear + cross-entropy (layers/head.py) against the reference (whole logits, then
F.cross_entropy): values and gradients in float64, every reduction, masks, ignored targets, blocks
that do not divide the rows; and the model's loss through it equal to the model's loss through
the reference, memory write cost and tied embeddings included."""
import pytest
import torch

from benchmarks.common import saved_bytes
from elephant.config import ModelConfig
from elephant.layers.head import (IGNORE_INDEX, default_block_rows, linear_cross_entropy,
                                  linear_cross_entropy_reference)
from elephant.model import ElephantLM


def inputs(N=37, D=8, V=23, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=gen, dtype=dtype).requires_grad_()
    w = torch.randn(V, D, generator=gen, dtype=dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=gen)
    t[3] = IGNORE_INDEX
    return h, w, t


MASKS = {"none": None, "bool": lambda n: torch.arange(n) % 3 != 1,
         "float": lambda n: torch.linspace(0, 2, n, dtype=torch.float64)}


@pytest.mark.parametrize("block_rows", [1, 5, 1000])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_blocked_equals_reference_values_and_gradients(reduction, mask, block_rows):
    h, w, t = inputs()
    m = MASKS[mask](h.shape[0]) if MASKS[mask] else None
    got = linear_cross_entropy(h, w, t, m, reduction, block_rows=block_rows)
    want = linear_cross_entropy_reference(h, w, t, m, reduction)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(got, (h, w), g)
    grads_ref = torch.autograd.grad(want, (h, w), g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_leading_dims_and_gradient_to_one_input_only():
    h, w, t = inputs(N=24)
    h3, t3 = h.detach().view(2, 12, -1).requires_grad_(), t.view(2, 12)
    for reduction in ("sum", "none"):
        got = linear_cross_entropy(h3, w.detach(), t3, reduction=reduction, block_rows=5)
        want = linear_cross_entropy_reference(h3, w.detach(), t3, reduction=reduction)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        (gh,) = torch.autograd.grad(got.sum(), h3)
        (gh_ref,) = torch.autograd.grad(want.sum(), h3)
        torch.testing.assert_close(gh, gh_ref, rtol=1e-10, atol=1e-12)


def test_without_gradient_equals_reference():
    h, w, t = inputs()
    with torch.no_grad():
        for reduction in ("mean", "sum", "none"):
            got = linear_cross_entropy(h, w, t, reduction=reduction, block_rows=4)
            want = linear_cross_entropy_reference(h, w, t, reduction=reduction)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            assert not got.requires_grad


def test_bf16_autocast_follows_the_reference():
    h, w, t = inputs(N=64, D=16, V=50, dtype=torch.float32)
    for reduction in ("sum", "none"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = linear_cross_entropy(h, w, t, reduction=reduction, block_rows=7)
            want = linear_cross_entropy_reference(h, w, t, reduction=reduction)
        assert got.dtype == want.dtype == torch.float32
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()
        assert rel(got, want) < 1e-4
        grads = torch.autograd.grad(got.sum(), (h, w))
        grads_ref = torch.autograd.grad(want.sum(), (h, w))
        for a, b in zip(grads, grads_ref):
            assert a.dtype == torch.float32 and rel(a, b) < 1e-2


def test_training_path_keeps_no_logits_for_backward():
    # the reference keeps (N, V) float32 log-probabilities for its backward; the blocked summed
    # loss keeps the input and weight gradients only: (N + V) x D
    N, D, V = 256, 16, 4096
    h, w, t = inputs(N=N, D=D, V=V, dtype=torch.float32)
    blocked = saved_bytes(lambda: linear_cross_entropy(h, w, t, reduction="sum", block_rows=64),
                          exclude=(h, w))
    reference = saved_bytes(lambda: linear_cross_entropy_reference(h, w, t, reduction="sum"),
                            exclude=(h, w))
    assert reference >= N * V * 4
    assert blocked <= (N + V) * D * 4 + 4096


def test_default_block_rows():
    cap = (4 << 30) // (4 * 50304) // 64 * 64            # 4 GiB of float32 logits, 64-row multiple
    assert default_block_rows(50304) == cap == 21312
    assert default_block_rows(256) == (4 << 30) // 1024
    assert default_block_rows(10**10) == 1
    # given the rows: the fewest blocks, evened out to 64-row multiples
    assert default_block_rows(50304, 32768) == 16384  # a training window of two chunks: 2 x 16384
    assert default_block_rows(50304, 16384) == 16384  # one chunk: one block
    assert default_block_rows(50304, cap) == cap      # one block
    assert default_block_rows(50304, 100) == 100
    assert default_block_rows(50304, 2 * cap + 1) == 14272   # 3 blocks (3 x 14272 >= 42625), not 2 + a tail
    for n in (1, 63, cap + 1, 65537, 280001):
        rows = default_block_rows(50304, n)
        blocks = -(-n // rows)
        assert rows <= cap and blocks == -(-n // cap), n


def test_bad_arguments_get_clear_errors():
    h, w, t = inputs()
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, t, reduction="avg")
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="head weight"):
        linear_cross_entropy(h, w[:, :-1], t)
    with pytest.raises(ValueError, match="loss_mask"):
        linear_cross_entropy(h, w, t, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="block_rows"):
        linear_cross_entropy(h, w, t, block_rows=0)


# ------------------------------------------------------------------------------- the model
def model_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_heads=4, layers="MA", d_mlp=48, d_state=16,
                mamba_head_dim=16, expand=2, d_conv=4, ssd_chunk=8, n_mem=2, kv_window=16,
                bptt_chunks=2, mem_gate_init=0.0, mem_write_cost=0.1)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_model_loss_blocked_equals_reference(reduction, tied):
    torch.manual_seed(0)
    model = ElephantLM(model_cfg(tied_embeddings=tied)).double().train()
    tokens = torch.randint(0, 97, (2, 3, 11))               # (chunk, lane, T + 1)
    mask = torch.rand(2, 3, 10) < 0.8                       # (chunk, lane, T)
    out = {}
    for blocked in (False, True):
        model.blocked_head = blocked
        model.zero_grad()
        state, total = None, 0
        for c in range(2):
            loss, state = model(tokens[c, :, :-1], state, targets=tokens[c, :, 1:],
                                loss_mask=mask[c], reduction=reduction)
            total = total + loss.sum()
        total.backward()
        out[blocked] = total.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-12, atol=1e-12)
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], g, rtol=1e-9, atol=1e-12, msg=name)


def test_fast_path_switch_covers_the_head():
    model = ElephantLM(model_cfg())
    assert model.blocked_head
    model.set_fast_paths(False)
    assert not model.blocked_head
    model.set_fast_paths(True)
    assert model.blocked_head
    with pytest.raises(ValueError, match="reduction"):
        model(torch.randint(0, 97, (1, 4)), targets=torch.randint(0, 97, (1, 4)), reduction="avg")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_block_math_equals_the_in_place_steps(dtype):
    # the block functions the GPU compiles (_nll_lse, _dlogits: logits kept in their dtype) compute
    # what the in-place float32 steps compute: NLL, log-sum-exp, (softmax - one-hot) * scale, zero
    # for ignored targets; run eagerly here (torch.compile fuses them on CUDA, tests/test_gpu_model)
    from elephant.layers.head import _block_dlogits, _block_nll, _dlogits, _nll_and_dlogits
    gen = torch.Generator().manual_seed(4)
    z = (torch.randn(29, 41, generator=gen, dtype=torch.float64) * 3).to(dtype)
    t = torch.randint(0, 41, (29,), generator=gen)
    t[[0, 7]] = IGNORE_INDEX
    scale = torch.rand(29, generator=gen, dtype=torch.float64)
    acc = torch.promote_types(dtype, torch.float32)
    nll, lse, dz = _nll_and_dlogits(z, t, scale.to(acc))
    nll_ref, lse_ref, p, safe, valid = _block_nll(z.to(acc).clone(), t)
    dz_ref = _block_dlogits(p, safe, valid, scale.to(acc)).to(dtype)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nll, nll_ref, **tol)
    torch.testing.assert_close(lse, lse_ref, **tol)
    assert dz.dtype == dtype and nll[[0, 7]].eq(0).all() and dz[[0, 7]].eq(0).all()
    torch.testing.assert_close(dz.to(acc), dz_ref.to(acc), **(tol if dtype != torch.bfloat16
                                                                  else dict(rtol=1e-2, atol=1e-4)))
    torch.testing.assert_close(_dlogits(z, lse, t, scale.to(acc)), dz)


def test_compiled_head_traces_the_functional_block_math(monkeypatch):
    # inside a graph torch.compile traces, the blocked loss uses the plain functional block math
    # (never the in-place steps nor the separately compiled kernels); the whole loss traces in
    # one graph and equals the reference, values and gradients. Eagerly with FUSED on it calls
    # the compiled kernels (forced on CPU here, recording wrappers of the plain functions).
    import torch._dynamo
    from elephant.layers import head
    seen = []

    def no_in_place(*args, **kwargs):
        raise AssertionError("the in-place block steps ran inside a traced graph")

    def recording(name):
        def fn(*args):
            seen.append(name)
            return head.PLAIN_FNS[name](*args)
        return fn
    monkeypatch.setattr(head, "FUSED", True)
    monkeypatch.setattr(head, "_fusable", lambda z: True)
    monkeypatch.setattr(head, "_FUSED_FNS", {n: recording(n) for n in head.PLAIN_FNS})
    h, w, t = inputs(dtype=torch.float32)
    m = MASKS["bool"](h.shape[0])
    want = linear_cross_entropy_reference(h, w, t, m, "sum")
    with monkeypatch.context() as traced:
        traced.setattr(head, "_block_nll", no_in_place)
        traced.setattr(head, "_block_dlogits", no_in_place)
        torch._dynamo.reset()
        fn = torch.compile(lambda h, w: linear_cross_entropy(h, w, t, m, "sum", block_rows=10),
                           fullgraph=True, backend="aot_eager")
        got = fn(h, w)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w))):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not seen
    eager = linear_cross_entropy(h, w, t, m, "sum", block_rows=10)
    torch.testing.assert_close(eager, want, rtol=1e-5, atol=1e-6)
    assert seen and set(seen) == {"grad"}
