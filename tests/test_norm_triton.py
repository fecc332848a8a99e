"""The gated RMSNorm's backward kernel (layers/norm_triton.py) under the Triton interpreter, held
to autograd of the reference ops: the values, and the gradients of y, z and the weight; z as a
strided slice of a wider projection output (as the Mamba block passes it), a last block of rows
cut short, rows not a power of two wide, bf16 inputs; and the Mamba block's use of it."""
import pytest
import torch

from elephant.config import ModelConfig
from elephant.layers import norm_triton
from elephant.layers.mamba import GatedRMSNorm, Mamba2
from numerics import rel


def grads(fn, y, z, w, dout):
    for t in (y, z, w):
        t.grad = None
    out = fn(y, z, w)
    out.backward(dout)
    return out.detach().clone(), y.grad.clone(), z.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("rows, D, dtype, tol", [
    (13, 48, torch.float32, 1e-5),    # a partial last block of rows; D not a power of two
    (16, 64, torch.float32, 1e-5),
    (9, 32, torch.bfloat16, 2e-2),
])
def test_backward_kernel_equals_autograd_of_reference(rows, D, dtype, tol):
    torch.manual_seed(0)
    wide = torch.randn(rows, 3 * D, dtype=dtype)          # z a strided slice, as in the block
    z = wide[:, D:2 * D].detach().requires_grad_()
    z_ref = z.detach().clone().requires_grad_()
    y = torch.randn(rows, D, dtype=dtype, requires_grad=True)
    y_ref = y.detach().clone().requires_grad_()
    w = (torch.rand(D) + 0.5).requires_grad_()
    w_ref = w.detach().clone().requires_grad_()
    dout = torch.randn(rows, D, dtype=dtype)
    eps = 1e-5
    got = grads(lambda a, b, c: norm_triton.gated_rmsnorm(a, b, c, eps), y, z, w, dout)
    want = grads(lambda a, b, c: norm_triton.reference(a, b, c, eps), y_ref, z_ref, w_ref, dout)
    for name, g, r in zip(("out", "dy", "dz", "dw"), got, want):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        assert rel(g, r) < tol, (name, rel(g, r))


def test_backward_kernel_three_dims_and_many_blocks_per_program():
    # (B, L, D) with z strided over b and l (a slice of (B, L, 3D)); more row blocks than the
    # interpreter's programs, so each program walks several and sums its weight gradient
    torch.manual_seed(1)
    B, L, D = 3, 11, 32
    wide = torch.randn(B, L, 3 * D, dtype=torch.float64).float()
    z = wide[..., :D].detach().requires_grad_()
    y = torch.randn(B, L, D, requires_grad=True)
    w = (torch.rand(D) + 0.5).requires_grad_()
    dout = torch.randn(B, L, D)
    got = grads(lambda a, b, c: norm_triton.gated_rmsnorm(a, b, c, 1e-6), y, z, w, dout)
    refs = [t.detach().clone().requires_grad_() for t in (y, z, w)]
    want = grads(lambda a, b, c: norm_triton.reference(a, b, c, 1e-6), *refs, dout)
    for name, g, r in zip(("out", "dy", "dz", "dw"), got, want):
        assert rel(g, r) < 1e-5, (name, rel(g, r))


def test_the_kernel_holds_the_weight_gradient_of_every_row():
    # a change of one row's output gradient in the last block moves the weight's gradient: no
    # block or row dropped from the programs' sums
    torch.manual_seed(2)
    N, D = 37, 16
    y, z = torch.randn(N, D), torch.randn(N, D)
    w = torch.ones(D)
    dout = torch.randn(N, D)
    base = norm_triton._bwd_op(dout, y, z, w, 1e-6)[2]
    dout2 = dout.clone()
    dout2[-1] += 1.0
    moved = norm_triton._bwd_op(dout2, y, z, w, 1e-6)[2]
    h = y * torch.nn.functional.silu(z)
    hn_last = h[-1] * torch.rsqrt(h[-1].pow(2).mean() + 1e-6)
    assert torch.allclose(moved - base, hn_last, atol=1e-5)


def test_module_takes_the_reference_on_the_cpu_and_unfused():
    # the module's fused path is for CUDA tensors; on the CPU (and with fused=False) the same
    # ops through autograd
    torch.manual_seed(3)
    norm = GatedRMSNorm(24, 1e-5)
    y, z = torch.randn(2, 5, 24), torch.randn(2, 5, 24)
    assert torch.equal(norm(y, z), norm_triton.reference(y, z, norm.weight, 1e-5))
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=4, layers="M", d_mlp=64, d_state=8,
                      mamba_head_dim=8)
    mixer = Mamba2(cfg)
    assert isinstance(mixer.norm, GatedRMSNorm) and mixer.norm.fused


def test_supported():
    y = torch.randn(2, 8)
    assert norm_triton.supported(y, y)   # the interpreter runs it on CPU tensors
    assert not norm_triton.supported(y.double(), y.double())
    assert not norm_triton.supported(y, torch.randn(2, 4))
