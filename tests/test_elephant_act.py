"""The fused elephant activation / GLU against the plain autograd expression (CPU).

The Triton kernels are checked here on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py);
tests/test_gpu_layers.py checks them on CUDA.
"""
import os

import pytest
import torch

from benchmarks.common import saved_bytes
from elephant.config import ModelConfig
from elephant.layers import elephant as E
from elephant.layers.elephant import (ElephantMLP, elephant, elephant_glu, elephant_glu_ref,
                                      elephant_ref, glu_down, glu_down_cat)

SPECIAL = [0.0, -0.0, 1e-30, -1e-30, 1e-4, -0.3, 0.999, 1.0, -1.0, 1.001, 2.0, -7.5, 60.0, 7e4,
           -1e6, 3e38]
PARAMS = [(1.0, 8.0), (0.7, 3.0), (2.0, 2.5), (1.5, 1.0)]

needs_interpreter = pytest.mark.skipif(
    not (E.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")
quiet_numpy = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's log2(0)


def exact_f_df(x: torch.Tensor, a: float, d: float):
    """f and f' in float64 from the textbook formulas (fine away from overflow)."""
    z = (x.double() / a).abs()
    f = 1 / (1 + z ** d)
    df = -torch.sign(x.double()) * d / a * z ** (d - 1) * f ** 2
    df = torch.where(x == 0, 0.0, df)
    return f, torch.nan_to_num(df, nan=0.0)


def inputs(n: int = 257, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.logspace(-3, 2, n)[torch.randperm(n, generator=gen)]
    return torch.cat([torch.tensor(SPECIAL), x]).to(dtype)


# ------------------------------------------------------------------------------- values, gradients
@pytest.mark.parametrize("a,d", PARAMS)
def test_fused_matches_reference_fp32(a, d):
    x = inputs().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = elephant(x, a, d), elephant_ref(x_ref, a, d)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-7)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    ok = x_ref.grad.isfinite()                    # the reference's pow backward gives NaN on overflow
    torch.testing.assert_close(x.grad[ok], x_ref.grad[ok], rtol=1e-5, atol=1e-7)
    f, df = exact_f_df(x.detach(), a, d)
    torch.testing.assert_close(x.grad.double(), dy.double() * df, rtol=1e-5, atol=1e-7)
    assert x.grad.isfinite().all()


def test_fused_is_finite_where_reference_overflows():
    x = torch.tensor([5e5, -1e6, 3e38], requires_grad=True)
    elephant_ref(x).sum().backward()
    assert x.grad.isnan().all()                   # |x|^7 = inf: inf * 0 in pow's backward
    x.grad = None
    y = elephant(x)
    y.sum().backward()
    assert torch.equal(y, torch.zeros(3)) and torch.equal(x.grad.abs(), torch.zeros(3))


def test_zero_and_tiny_inputs():
    x = torch.tensor([0.0, -0.0, 1e-38, -1e-30], requires_grad=True)
    y = elephant(x)
    y.sum().backward()
    assert torch.equal(y, torch.ones(4))
    assert torch.equal(x.grad.abs(), torch.zeros(4))
    for d in (1.0, 0.5):                          # f'(0) := 0 even where the one-sided limits differ
        x = torch.zeros(3, requires_grad=True)
        elephant(x, 1.0, d).sum().backward()
        assert torch.equal(x.grad, torch.zeros(3))


@pytest.mark.parametrize("a,d", PARAMS[:2])
def test_fused_glu_matches_reference_bf16(a, d):
    gen = torch.Generator().manual_seed(1)
    u = (torch.randn(64, 48, generator=gen) * 3).bfloat16().requires_grad_()
    g = (torch.randn(64, 48, generator=gen) * 2).bfloat16().requires_grad_()
    u_ref, g_ref = (t.detach().clone().requires_grad_() for t in (u, g))
    y, y_ref = elephant_glu(u, g, a, d), elephant_glu_ref(u_ref, g_ref, a, d)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(u.grad, u_ref.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(g.grad, g_ref.grad, rtol=3e-2, atol=5e-2)
    # the fused op computes in float32 and rounds once: within one bf16 ulp of the exact value
    exact = u.detach().double() * exact_f_df(g.detach(), a, d)[0]
    torch.testing.assert_close(y.double(), exact, rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("a,d", PARAMS)
def test_gradcheck_fp64(a, d):
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(6, 5, dtype=torch.float64, generator=gen) * 2
    g = torch.where(g.abs() < 0.05, g + 0.3, g).requires_grad_()   # away from the kink at 0 (d <= 1)
    u = torch.randn(6, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(3, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: elephant(x, a, d), (g,))
    assert torch.autograd.gradcheck(lambda u, g: elephant_glu(u, g, a, d), (u, g))
    assert torch.autograd.gradcheck(lambda u, g, w: glu_down(u, g, w, a, d), (u, g, w))
    ug = torch.cat([u, g], -1).detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda ug, w: glu_down_cat(ug, w, a, d), (ug, w))


def test_glu_down_cat_equals_glu_down_on_the_halves():
    # [u | g] in one tensor (the MLP's one product) against u and g apart: values and gradients
    gen = torch.Generator().manual_seed(6)
    ug = (torch.randn(2, 7, 2 * 12, dtype=torch.float64, generator=gen) * 2).requires_grad_()
    w = torch.randn(5, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    u, g = (t.detach().clone().requires_grad_() for t in ug.split(12, -1))
    w2 = w.detach().clone().requires_grad_()
    dy = torch.randn(2, 7, 5, dtype=torch.float64, generator=gen)
    y, y_ref = glu_down_cat(ug, w, 0.7, 3.0), glu_down(u, g, w2, 0.7, 3.0)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-14)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(ug.grad, torch.cat([u.grad, g.grad], -1), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-12, atol=1e-14)


def test_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(3)
    u = torch.randn(40, 24, generator=gen).t().requires_grad_()      # (24, 40), strides (1, 24)
    g = (torch.randn(24, 80, generator=gen) * 2)[:, ::2].requires_grad_()
    assert not u.is_contiguous() and not g.is_contiguous()
    u_ref, g_ref = (t.detach().clone().requires_grad_() for t in (u, g))
    y, y_ref = elephant_glu(u, g), elephant_glu_ref(u_ref, g_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-7)
    dy = torch.randn(40, 24, generator=gen).t()
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(u.grad, u_ref.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g.grad, g_ref.grad, rtol=1e-5, atol=1e-6)


def test_shape_mismatch_is_an_error():
    with pytest.raises(RuntimeError, match="same shape"):
        elephant_glu(torch.ones(3, 4), torch.ones(4, 3))


def test_custom_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(4)
    u, g = torch.randn(2, 3, 8, generator=gen), torch.randn(2, 3, 8, generator=gen)
    dy = torch.randn(2, 3, 8, generator=gen)
    torch.library.opcheck(E._act_op, (g.requires_grad_(), 1.0, 8.0))
    torch.library.opcheck(E._glu_op, (u.requires_grad_(), g, 1.0, 8.0))
    torch.library.opcheck(E._glu_bwd_op, (dy, u.detach(), g.detach(), 1.0, 8.0))
    ug = torch.cat([u, g], -1).detach()   # the op has no autograd formula of its own (_GLUDownCat)
    torch.library.opcheck(E._glu_cat_op, (ug, 1.0, 8.0))
    torch.library.opcheck(E._glu_cat_bwd_op, (dy, ug, 1.0, 8.0))


def test_mlp_traces_in_one_graph():
    cfg = ModelConfig(d_model=16, d_mlp=24)
    mlp = ElephantMLP(cfg)
    h = torch.randn(2, 5, 16, requires_grad=True)
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    y = compiled(h)
    y.sum().backward()
    torch.testing.assert_close(y, mlp(h), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------- Triton kernels
@needs_interpreter
@quiet_numpy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_u", [False, True])
def test_triton_kernels_match_eager(dtype, with_u):
    g = inputs(2500 - len(SPECIAL), dtype)       # not a multiple of the block
    u = torch.randn_like(g) if with_u else None
    dy = torch.randn_like(g)
    y_tr = E.forward_triton(u, g, 0.8, 8.0)
    du_tr, dg_tr = E.backward_triton(dy, u, g, 0.8, 8.0)
    y_ea = E._forward(u, g, 0.8, 8.0)
    du_ea, dg_ea = E._backward(dy, u, g, 0.8, 8.0)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    assert y_tr.dtype == dg_tr.dtype == dtype
    torch.testing.assert_close(y_tr, y_ea, **tol)
    torch.testing.assert_close(dg_tr, dg_ea, **tol)
    assert dg_tr.isfinite().all()
    if with_u:
        torch.testing.assert_close(du_tr, du_ea, **tol)


@needs_interpreter
@quiet_numpy
def test_triton_kernels_take_non_contiguous_inputs():
    g = torch.randn(64, 32).t() * 2
    u = torch.randn(64, 32)[:, :].t()
    dy = torch.randn(32, 128)[:, ::2]
    torch.testing.assert_close(E.forward_triton(u, g, 1.0, 8.0), E._forward(u, g, 1.0, 8.0))
    for got, want in zip(E.backward_triton(dy, u, g, 1.0, 8.0), E._backward(dy, u, g, 1.0, 8.0)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@needs_interpreter
@quiet_numpy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_cat_kernels_match_eager(dtype):
    # [u | g] rows read in place from a slice of a wider tensor (row stride 2F + 6), F = 37 (not
    # a power of two), a last block cut short; [du | dg] written whole
    F2 = 37
    wide = torch.randn(3, 29, 2 * F2 + 6) * 3
    ug = wide.to(dtype)[..., 3:3 + 2 * F2]
    assert ug.stride(-2) == 2 * F2 + 6
    dy = torch.randn(3, 29, F2).to(dtype)
    u, g = ug[..., :F2], ug[..., F2:]
    y = E.forward_cat_triton(ug, 0.8, 8.0)
    dug = E.backward_cat_triton(dy, ug, 0.8, 8.0)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    assert y.shape == (3, 29, F2) and dug.shape == ug.shape and dug.is_contiguous()
    torch.testing.assert_close(y, E._forward(u, g, 0.8, 8.0), **tol)
    du, dg = E._backward(dy, u, g, 0.8, 8.0)
    torch.testing.assert_close(dug, torch.cat([du, dg], -1), **tol)


# ------------------------------------------------------------------------------- memory
def test_fused_glu_keeps_only_u_and_g():
    u = torch.randn(64, 96, requires_grad=True)
    g = torch.randn(64, 96, requires_grad=True)
    nbytes = u.numel() * 4
    assert saved_bytes(elephant_glu, u, g) == 2 * nbytes
    assert saved_bytes(elephant, g) == nbytes
    assert saved_bytes(elephant_glu_ref, u, g) >= 4 * nbytes   # |g|, |g|^d, f, u (and more)


@pytest.mark.parametrize("one_product", [False, True])
def test_fused_mlp_keeps_input_and_u_g(one_product):
    cfg = ModelConfig(d_model=32, d_mlp=96)
    mlp = ElephantMLP(cfg)
    mlp.one_product = one_product
    h = torch.randn(4, 16, 32, requires_grad=True)
    tokens = 4 * 16
    fused = saved_bytes(mlp, h, exclude=mlp.parameters())
    mlp.fused = False
    reference = saved_bytes(mlp, h, exclude=mlp.parameters())
    # h and u, g ([u | g]) per token; one product also keeps the stacked up/gate weight it read
    assert fused == 4 * tokens * (32 + 2 * 96) + (4 * (2 * 96) * 32 if one_product else 0)
    assert reference >= 4 * tokens * (32 + 6 * 96)            # h, u, g, |g|, |g|^d, f, product


@pytest.mark.parametrize("one_product", [False, True])
def test_fused_mlp_equals_reference_mlp(one_product):
    torch.manual_seed(5)
    cfg = ModelConfig(d_model=24, d_mlp=40, elephant_a=0.5, elephant_d=4.0)
    mlp = ElephantMLP(cfg).double()
    mlp.one_product = one_product
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.3)
    h = torch.randn(3, 7, 24, dtype=torch.float64, requires_grad=True)
    grads = []
    for fused in (True, False):
        mlp.fused = fused
        mlp.zero_grad()
        h.grad = None
        y = mlp(h)
        (y * torch.linspace(-1, 1, 24, dtype=torch.float64)).sum().backward()
        grads.append([y.detach(), h.grad] + [p.grad for p in mlp.parameters()])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_mlp_under_bf16_autocast():
    cfg = ModelConfig(d_model=16, d_mlp=32)
    mlp = ElephantMLP(cfg)
    h = torch.randn(2, 8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mlp(h)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in mlp.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mlp.fused = False
        y_ref = mlp(h)
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-3)


def test_whole_powers_by_squaring_equal_pow():
    # the eager path's powers: whole exponents up to 16 by repeated squaring (reciprocal for
    # negative ones: within 16 float32 ulps), any other exponent by pow; float64 pow is the reference
    from elephant.layers.elephant import _pow
    z = torch.cat([torch.rand(4096) * 3, torch.tensor([0.0, 1.0, 1e-3, 40.0])])
    for e in (1.0, 2.0, 7.0, 8.0, 9.0, 16.0, -1.0, -8.0, 2.5, -3.5, 17.0, 0.0):
        want = z.double().pow(e)
        got = _pow(z, e).double()
        finite = want.isfinite() & (want.abs() < 1e30) & (want.abs() > 1e-30)
        assert torch.allclose(got[finite], want[finite], rtol=16 * 2.0 ** -24, atol=0), e
        assert (got[~finite].isinf() == want[~finite].isinf()).all(), e   # 0 ** -8: inf in both
