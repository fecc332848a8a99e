"""linear_nll_triton's kernel (evaluation's head without its logits) against a float64 reference and
the blocked path it would replace (head._forward_nll), under TRITON_INTERPRET=1 (tests/conftest.py)
with small tiles; tests/test_gpu_model.py holds it to the blocked path on CUDA."""
import os

import pytest
import torch

from elephant.layers import head, linear_nll_triton
from elephant.layers.head import IGNORE_INDEX, linear_cross_entropy, linear_cross_entropy_reference
from numerics import rel

pytestmark = pytest.mark.skipif(
    not (linear_nll_triton.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="CPU tensors through the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py "
           "without a GPU); the CUDA form is in tests/test_gpu_model.py")


def inputs(n, D, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, D, generator=gen) * 2).to(dtype)
    w = (torch.randn(V, D, generator=gen) * 0.3).to(dtype)
    t = torch.randint(0, V, (n,), generator=gen)
    t[::5] = IGNORE_INDEX
    return h, w, t


def reference(h, w, t):
    z = h.double() @ w.double().t()
    lse = torch.logsumexp(z, 1)
    valid = t != IGNORE_INDEX
    picked = z.gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1)
    return torch.where(valid, lse - picked, 0.0), lse


# rows and vocabulary not multiples of the 16-wide tiles, D not a multiple of BK (40), one row
@pytest.mark.parametrize("n,D,V", [(37, 40, 203), (1, 16, 16), (20, 64, 50)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_float64_logits(n, D, V, dtype):
    h, w, t = inputs(n, D, V, dtype)
    want_nll, want_lse = reference(h, w, t)
    for split in (None, 1):   # the default split (here a tile a part), and every tile in one
        nll, lse = linear_nll_triton.linear_nll(h, w, t, split=split)
        assert nll.dtype == lse.dtype == torch.float32 and nll.shape == lse.shape == (n,)
        assert nll[t == IGNORE_INDEX].eq(0).all()
        # float32 sums of exact products (16-bit operands) or full-precision float32 ones
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(nll.double(), want_nll, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [1, 2, 5, 13, 16])
def test_every_split_of_the_vocabulary_gives_the_same_rows(split):
    # parts of 16 columns or more: with 13 and 16 parts over 203 columns (13 tiles) the last parts
    # hold none, and the combination must not let them count
    h, w, t = inputs(37, 40, 203, torch.float32, seed=1)
    nll, lse = linear_nll_triton.linear_nll(h, w, t, split=split)
    want_nll, want_lse = reference(h, w, t)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nll.double(), want_nll, rtol=1e-5, atol=1e-5)


def test_a_target_outside_the_vocabulary_reads_no_logit():
    # (the trainer refuses such a tokenizer before any step; the kernel must still not read
    # outside the row, as ce_triton and the blocked path)
    h, w, t = inputs(6, 16, 40, torch.float32)
    t[1], t[2] = 40, 1000
    nll, lse = linear_nll_triton.linear_nll(h, w, t)
    torch.testing.assert_close(nll[1:3], lse[1:3])          # the picked logit counted as 0
    assert torch.isfinite(nll).all()


def test_far_apart_logits_keep_the_log_sum_exp_exact():
    # the running maximum jumps between tiles (a row's largest logit in its last tile, in its
    # first, values whose exp overflows float32): the rescaled sums stay finite and exact
    h, w, t = inputs(4, 16, 64, torch.float32)
    w[50] = 0.0
    w[50, 0] = 200.0                                          # row 0: a huge logit in tile 3
    h[0, 0], h[1, 0], h[2, 0], h[3, 0] = 1.0, -1.0, 0.0, 3.0
    w[3] = 0.0
    w[3, 1] = 150.0                                           # rows with h[:, 1] > 0: in tile 0
    want_nll, want_lse = reference(h, w, t)
    # split 1: one program walks every tile (the in-kernel rescaling); the default split gives
    # each part a tile here (the parts' combination)
    for split in (1, None):
        nll, lse = linear_nll_triton.linear_nll(h, w, t, split=split)
        assert torch.isfinite(lse).all()
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-4)
        torch.testing.assert_close(nll.double(), want_nll, rtol=1e-6, atol=1e-4)


def test_evaluation_head_takes_the_kernel_when_switched_on(monkeypatch):
    # head.EVAL_FUSED (on by default) routes the no-gradient per-token loss (evaluation) on CUDA
    # through the kernel; here on CPU tensors under the interpreter (head._use_eval_kernel patched
    # to allow them): the same losses as the reference and as the blocked path, for every
    # reduction; with gradients (training) the blocked path runs, the switch notwithstanding
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(2, 19, 32, generator=gen)
    w = torch.randn(90, 32, generator=gen) * 0.2
    t = torch.randint(0, 90, (2, 19), generator=gen)
    mask = torch.rand(2, 19, generator=gen) < 0.8
    calls = []
    real = linear_nll_triton.linear_nll
    monkeypatch.setattr(linear_nll_triton, "linear_nll",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    assert head.EVAL_FUSED and not head._use_eval_kernel(h, w)   # CPU tensors: the blocked path
    for fused in (False, True):
        monkeypatch.setattr(head, "EVAL_FUSED", fused)
        monkeypatch.setattr(head, "_use_eval_kernel",
                            lambda a, b: head.EVAL_FUSED and linear_nll_triton.supported(a, b))
        with torch.no_grad():
            for reduction in ("none", "sum", "mean"):
                got = linear_cross_entropy(h, w, t, mask, reduction, block_rows=8)
                want = linear_cross_entropy_reference(h, w, t, mask, reduction)
                assert rel(got, want) < 1e-5, (fused, reduction)
        assert len(calls) == (3 if fused else 0)
        calls.clear()
    hg = h.clone().requires_grad_()
    linear_cross_entropy(hg, w, t, mask, "sum", block_rows=8).backward()
    assert not calls and hg.grad is not None
