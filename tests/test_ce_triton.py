"""ce_triton's loss kernel against the plain block functions it replaces on the GPU (head._nll_lse,
_nll_and_dlogits, _dlogits), under TRITON_INTERPRET=1 (tests/conftest.py) with small blocks;
tests/test_gpu_model.py holds the blocked head to the reference on CUDA with the kernel in place."""
import os

import pytest
import torch

from elephant.layers import ce_triton, head
from elephant.layers.head import IGNORE_INDEX, linear_cross_entropy, linear_cross_entropy_reference

pytestmark = pytest.mark.skipif(
    not (ce_triton.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="CPU tensors through the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py "
           "without a GPU); the CUDA forms are in the test_gpu_*.py files")


def logits(n, V, dtype, spread=3.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, V, generator=gen, dtype=torch.float64) * spread
    t = torch.randint(0, V, (n,), generator=gen)
    t[::4] = IGNORE_INDEX
    return z.to(dtype), t, torch.rand(n, generator=gen, dtype=torch.float64).float()


@pytest.mark.parametrize("V", [1, 63, 64, 203])       # blocks of 64 under the interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reversed_walk,hints", [(True, True), (False, False)])
def test_kernel_equals_the_plain_block_functions(V, dtype, reversed_walk, hints, monkeypatch):
    # (the L2 eviction hints change no value: the interpreter takes them and ignores them, so both
    # settings run here; the GPU test runs the kernel as it is launched)
    monkeypatch.setattr(ce_triton, "GRAD_REVERSED", reversed_walk)
    monkeypatch.setattr(ce_triton, "L2_HINTS", hints)
    z, t, scale = logits(9, V, dtype)
    nll, lse = ce_triton.nll_lse(z, t)
    want_nll, want_lse = head._nll_lse(z, t)
    torch.testing.assert_close(nll, want_nll, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert nll[::4].eq(0).all()
    nll2, lse2, dz = ce_triton.nll_lse_dlogits(z, t, scale)
    _, _, want_dz = head._nll_and_dlogits(z, t, scale)
    assert dz.dtype == dtype and dz[::4].eq(0).all()
    torch.testing.assert_close(nll2, nll, rtol=0, atol=0)
    torch.testing.assert_close(lse2, lse, rtol=0, atol=0)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(dz.float(), want_dz.float(), **tol)
    # from a log-sum-exp made before (the per-token path's backward)
    torch.testing.assert_close(ce_triton.dlogits(z, lse, t, scale).float(), want_dz.float(), **tol)


def test_online_log_sum_exp_keeps_far_apart_blocks_exact():
    # the running maximum jumps between blocks (a row's largest logit in its last block, or in its
    # first, values that overflow exp in float32): the rescaled sums stay finite and exact
    z = torch.zeros(3, 200, dtype=torch.float64)
    z[0, 190] = 300.0
    z[1, 3] = 300.0
    z[2] = torch.linspace(-500, 100, 200, dtype=torch.float64)
    t = torch.tensor([190, 150, 199])
    nll, lse = ce_triton.nll_lse(z.float(), t)
    want = torch.logsumexp(z, dim=-1)
    torch.testing.assert_close(lse.double(), want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(nll.double(), want - z[torch.arange(3), t], rtol=1e-6, atol=1e-4)
    assert torch.isfinite(ce_triton.nll_lse_dlogits(z.float(), t, torch.ones(3))[2]).all()


def test_bad_logits_are_named():
    z, t, _ = logits(4, 10, torch.float32)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ce_triton.nll_lse(z.t().contiguous().t(), t)
    with pytest.raises(RuntimeError, match="targets"):
        ce_triton.nll_lse(z, t[:3])


def test_head_with_the_kernel_equals_the_reference(monkeypatch):
    # the blocked loss through the kernel (forced on the CPU here): the reference's loss and
    # gradients, summed (training) and per token (its backward remakes the logits). Traced by
    # torch.compile it runs on CUDA only (the interpreter takes no fake tensors):
    # tests/test_gpu_model.py::test_blocked_head_equals_reference_on_cuda[sum-bf16-True]
    monkeypatch.setattr(head, "_use_ce_kernel", lambda z: ce_triton.supported(z))
    monkeypatch.setattr(head, "_fusable", lambda z: True)
    calls = []

    def recording(name, fn):
        def call(*args):
            calls.append(name)
            return fn(*args)
        return call
    monkeypatch.setattr(ce_triton, "FNS", {name: recording(name, fn)
                                           for name, fn in ce_triton.FNS.items()})
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2, 11, 16, generator=gen, requires_grad=True)
    w = (torch.randn(70, 16, generator=gen) * 0.3).requires_grad_()
    t = torch.randint(0, 70, (2, 11), generator=gen)
    t[0, 3] = IGNORE_INDEX
    mask = torch.rand(2, 11, generator=gen) > 0.3
    for reduction in ("mean", "none"):
        want = linear_cross_entropy_reference(h, w, t, mask, reduction)
        want_g = torch.autograd.grad(want.sum(), (h, w))
        got = linear_cross_entropy(h, w, t, mask, reduction, block_rows=8)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=reduction)
        for a, b in zip(torch.autograd.grad(got.sum(), (h, w)), want_g):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=reduction)
    assert set(calls) == {"grad", "nll", "dlogits"}


def test_unknown_kernel_choice_is_named():
    import subprocess
    import sys
    env = {**os.environ, "ELEPHANT_CE": "bogus"}
    run = subprocess.run([sys.executable, "-c", "import elephant.layers.head"], env=env,
                         capture_output=True, text=True)
    assert run.returncode != 0 and "ELEPHANT_CE must be 'triton' or 'inductor'" in run.stderr
