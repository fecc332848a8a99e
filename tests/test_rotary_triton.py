"""The attention's q/k/v kernel (layers/rotary_triton.py) under the Triton interpreter, held to
Attention.project's plain path: values, and the gradients of the input, the projection and the
q/k norm weights; with and without the norm, rotary periods cut off, negative positions."""
import pytest
import torch

from elephant.config import ModelConfig
from elephant.layers import rotary_triton
from elephant.layers.attention import Attention, rotary_cos_sin


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("qk_norm, max_period, dtype, tol", [
    (True, 0.0, torch.float32, 1e-5),
    (False, 0.0, torch.float32, 1e-5),
    (True, 40.0, torch.float32, 1e-5),   # the slow pairs not rotated
    (True, 0.0, torch.bfloat16, 2e-2),
])
def test_kernel_equals_project(qk_norm, max_period, dtype, tol):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=4, layers="A", d_mlp=64, qk_norm=qk_norm,
                      rope_max_period=max_period)
    attn = Attention(cfg).to(dtype)
    if qk_norm:   # gains away from 1, so that their gradients and use are tested
        with torch.no_grad():
            attn.q_norm.weight.copy_(torch.rand(cfg.head_dim) + 0.5)
            attn.k_norm.weight.copy_(torch.rand(cfg.head_dim) + 0.5)
    B, S, H, hd = 2, 7, cfg.n_heads, cfg.head_dim
    x = torch.randn(B, S, cfg.d_model, dtype=dtype, requires_grad=True)
    pos = torch.arange(S).expand(B, S) + torch.tensor([[-3], [1000]])   # lane 0 starts negative
    grads = [torch.randn(B, H, S, hd, dtype=dtype) for _ in range(3)]

    def run(fused):
        for p in [x, *attn.parameters()]:
            p.grad = None
        if fused:
            y = attn.qkv(x)
            cos, sin = rotary_cos_sin(pos, hd, attn.rope_base, torch.float32, attn.rope_max_period)
            out = rotary_triton.qkv_prepare(
                y, cos.squeeze(1), sin.squeeze(1), attn.q_norm.weight if qk_norm else None,
                attn.k_norm.weight if qk_norm else None, cfg.norm_eps, H)
        else:
            out = attn.project(x, pos)   # on the CPU: the plain path
        sum((o.float() * g.float()).sum() for o, g in zip(out, grads)).backward()
        named = {"x": x.grad, **{n: p.grad for n, p in attn.named_parameters() if p.grad is not None}}
        return [o.detach().clone() for o in out], {n: g.clone() for n, g in named.items()}

    (want, want_g), (got, got_g) = run(False), run(True)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
        assert rel(a, b) < tol
    assert got_g.keys() == want_g.keys() and ("q_norm.weight" in got_g) == qk_norm
    for name, g in want_g.items():
        assert rel(got_g[name], g) < tol, name


def test_supported_shapes():
    y = torch.zeros(2, 3, 3 * 4 * 16)
    assert rotary_triton.supported(y, 4, 16)
    assert not rotary_triton.supported(y, 3, 16) and not rotary_triton.supported(y, 4, 12)
    assert not rotary_triton.supported(y.double(), 4, 16)
