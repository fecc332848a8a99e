"""The attention's q/k/v kernel (layers/rotary_triton.py) under the Triton interpreter, held to
Attention.project's plain path: values, and the gradients of the input, the projection and the
q/k norm weights; with and without the norm, rotary periods cut off, negative positions; the
outputs' token-major storage, and output gradients at any strides."""
import pytest
import torch

from elephant.config import ModelConfig
from elephant.layers import rotary_triton
from elephant.layers.attention import Attention, rotary_cos_sin
from numerics import rel


def make_layer(qk_norm=True, max_period=0.0, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=4, layers="A", d_mlp=64, qk_norm=qk_norm,
                      rope_max_period=max_period)
    attn = Attention(cfg).to(dtype)
    if qk_norm:   # gains away from 1, so that their gradients and use are tested
        with torch.no_grad():
            attn.q_norm.weight.copy_(torch.rand(cfg.head_dim) + 0.5)
            attn.k_norm.weight.copy_(torch.rand(cfg.head_dim) + 0.5)
    return cfg, attn


def fused_project(attn, x, pos):
    """q, k, v of x (B, S, D) at pos (B, S) through the kernel."""
    y = attn.qkv(x)
    cos, sin = rotary_cos_sin(pos, attn.head_dim, attn.rope_base, torch.float32,
                              attn.rope_max_period)
    norm = attn.q_norm is not None
    return rotary_triton.qkv_prepare(
        y, cos.squeeze(1), sin.squeeze(1), attn.q_norm.weight if norm else None,
        attn.k_norm.weight if norm else None, attn.q_norm.eps if norm else 0.0, attn.n_heads)


def run(attn, x, pos, grads, fused):
    """The outputs, and the gradients (by name) of x and the layer's parameters from output
    gradients `grads`, of the kernel (fused) or the plain path."""
    for p in [x, *attn.parameters()]:
        p.grad = None
    out = fused_project(attn, x, pos) if fused else attn.project(x, pos)  # CPU: the plain path
    torch.autograd.backward(out, grads)
    named = {"x": x.grad, **{n: p.grad for n, p in attn.named_parameters() if p.grad is not None}}
    return [o.detach().clone() for o in out], {n: g.clone() for n, g in named.items()}


def inputs(cfg, dtype=torch.float32, B=2, S=7):
    x = torch.randn(B, S, cfg.d_model, dtype=dtype, requires_grad=True)
    pos = torch.arange(S).expand(B, S) + torch.tensor([[-3], [1000]])   # lane 0 starts negative
    return x, pos


@pytest.mark.parametrize("qk_norm, max_period, dtype, tol", [
    (True, 0.0, torch.float32, 1e-5),
    (False, 0.0, torch.float32, 1e-5),
    (True, 40.0, torch.float32, 1e-5),   # the slow pairs not rotated
    (True, 0.0, torch.bfloat16, 2e-2),
])
def test_kernel_equals_project(qk_norm, max_period, dtype, tol):
    cfg, attn = make_layer(qk_norm, max_period, dtype)
    x, pos = inputs(cfg, dtype)
    B, S, H, hd = *x.shape[:2], cfg.n_heads, cfg.head_dim
    grads = [torch.randn(B, H, S, hd, dtype=dtype) for _ in range(3)]
    (want, want_g), (got, got_g) = run(attn, x, pos, grads, False), run(attn, x, pos, grads, True)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel(a, b) < tol
    assert got_g.keys() == want_g.keys() and ("q_norm.weight" in got_g) == qk_norm
    for name, g in want_g.items():
        assert rel(got_g[name], g) < tol, name


def test_outputs_are_views_of_token_major_storage(monkeypatch):
    # q, k, v (B, H, S, hd) over (B, S, H, hd) storage: attend_varlen's (B * S, H, hd) rows are
    # views of them; so too in the fake tensors torch.compile traces the op with (the interpreter
    # takes no fake tensors: there the kernels are not launched)
    from torch._subclasses.fake_tensor import FakeTensorMode
    cfg, attn = make_layer()
    x, pos = inputs(cfg)
    B, S, H, hd = *x.shape[:2], cfg.n_heads, cfg.head_dim
    with torch.no_grad():
        out = fused_project(attn, x, pos)
        monkeypatch.setattr(torch.library, "wrap_triton",
                            lambda kernel: {(B * S,): lambda *args, **kwargs: None})
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = fused_project(attn, mode.from_tensor(x), mode.from_tensor(pos))
    for o, f in zip(out, fake):
        assert o.shape == f.shape == (B, H, S, hd)
        assert o.transpose(1, 2).is_contiguous() and not o.is_contiguous()
        assert f.stride() == o.stride() == (S * H * hd, hd, H * hd, 1)
        assert o.transpose(1, 2).reshape(B * S, H, hd).data_ptr() == o.data_ptr()   # a view


def grad_layouts(B, H, S, hd):
    """Each layout's maker: (B, H, S, hd) values -> a tensor of those values at its strides."""
    def token_major(g):    # as the varlen path's dq comes back
        return g.transpose(1, 2).contiguous().transpose(1, 2)

    def sliced(g):         # as its dk, dv come back: the chunk's rows of [window | chunk]
        full = torch.full((B, 3 + S, H, hd), float("nan"), dtype=g.dtype)
        full[:, 3:] = g.transpose(1, 2)
        return full[:, 3:].transpose(1, 2)

    def sequence_major(g):  # (S, H, B, hd) storage, padded heads
        full = torch.full((S, H + 1, B, hd), float("nan"), dtype=g.dtype)
        full[:, :H] = g.permute(2, 1, 0, 3)
        return full[:, :H].permute(2, 1, 0, 3)

    def strided_hd(g):     # every other element over hd: copied for the kernel
        full = torch.full((B, H, S, 2 * hd), float("nan"), dtype=g.dtype)
        full[..., ::2] = g
        return full[..., ::2]
    return {"contiguous": lambda g: g.contiguous(), "token_major": token_major, "sliced": sliced,
            "sequence_major": sequence_major, "strided_hd": strided_hd}


@pytest.mark.parametrize("layouts", [
    ("contiguous",) * 3, ("token_major",) * 3, ("sliced",) * 3, ("sequence_major",) * 3,
    ("strided_hd",) * 3, ("token_major", "sliced", "contiguous"),
    ("sequence_major", "token_major", "sliced"),
])
def test_backward_takes_gradients_at_any_strides(layouts):
    # dq, dk, dv at each layout (mixed: each its own strides) give the gradients that contiguous
    # ones give, bitwise, and the plain path's
    cfg, attn = make_layer()
    x, pos = inputs(cfg)
    B, S, H, hd = *x.shape[:2], cfg.n_heads, cfg.head_dim
    grads = [torch.randn(B, H, S, hd) for _ in range(3)]
    makers = grad_layouts(B, H, S, hd)
    strided = [makers[name](g) for name, g in zip(layouts, grads)]
    for g, s, name in zip(grads, strided, layouts):
        assert torch.equal(g, s) and (s.is_contiguous() == (name == "contiguous"))
    _, want_g = run(attn, x, pos, grads, False)
    _, same_g = run(attn, x, pos, [g.contiguous() for g in grads], True)
    _, got_g = run(attn, x, pos, strided, True)
    assert got_g.keys() == want_g.keys() == same_g.keys()
    for name, g in want_g.items():
        assert torch.equal(got_g[name], same_g[name]), name
        assert rel(got_g[name], g) < 1e-5, name


def test_supported_shapes():
    y = torch.zeros(2, 3, 3 * 4 * 16)
    assert rotary_triton.supported(y, 4, 16)
    assert not rotary_triton.supported(y, 3, 16) and not rotary_triton.supported(y, 4, 12)
    assert not rotary_triton.supported(y.double(), 4, 16)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_project_by_the_kernel_also_gives_the_keys_before_rotary(monkeypatch, qk_norm):
    """Kept tokens store each key before rotary (`project(raw=True)`). By the kernel, project
    gives them too, as the plain path does (the same ops on the same rows), beside the kernel's
    q, k and v; the raw keys carry no gradient there (kept tokens are carried without one)."""
    cfg, attn = make_layer(qk_norm=qk_norm)
    x, pos = inputs(cfg)
    want = attn.project(x, pos, raw=True)                           # CPU: the plain path
    monkeypatch.setattr(attn, "use_fused", lambda y: True)
    got = attn.project(x, pos, raw=True)
    assert len(got) == len(want) == 4
    for a, b in zip(got[:3], want[:3]):
        assert rel(a, b) < 1e-5
    torch.testing.assert_close(got[3], want[3], rtol=0, atol=0)
    assert not got[3].requires_grad
    assert all(torch.equal(a, b) for a, b in zip(got[:3], fused_project(attn, x, pos)))
