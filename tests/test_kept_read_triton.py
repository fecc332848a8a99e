"""The fused kept read (layers/kept_read_triton.py) against the dense read it stands in for
(kept_read.top_kept_read's score matrix and top-k), under TRITON_INTERPRET=1 (tests/conftest.py)
with 16 x 16 blocks. The interpreter has no bfloat16 product, so float16 stands in for the
16-bit scores here; bfloat16, the compiled op and the recall setting's shape are in
tests/test_gpu_layers.py."""
import math
import os

import pytest
import torch

from elephant.layers import kept_read, kept_read_triton

pytestmark = pytest.mark.skipif(
    not (kept_read_triton.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="CPU tensors through the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py "
           "without a GPU); the CUDA forms are in tests/test_gpu_layers.py")


def case(dtype, seed=0):
    """5 lanes, 2 heads, 21 queries (a block and a part), 37 kept tokens (two tiles and a part),
    keys of 16 and values of 32: lane 0 every kept token valid, lane 1 some, lane 2 three, lane 3
    none, lane 4 the first ten (in fewer groups than a query reads keys: the search's floor is
    then the lowest score)."""
    g = torch.Generator().manual_seed(seed)
    B, H, S, K = 5, 2, 21, 37
    q, keys = (torch.randn(B, H, n, 16, generator=g).to(dtype) for n in (S, K))
    values = torch.randn(B, H, K, 32, generator=g).to(dtype)
    valid = torch.rand(B, K, generator=g) < 0.6
    valid[0], valid[3] = True, False
    valid[2] = torch.arange(K) % 12 == 5                     # 3 valid
    valid[4] = torch.arange(K) < 10
    return q, keys, values, valid


@pytest.mark.parametrize("dtype,read", [(torch.float32, 5), (torch.float16, 5), (torch.float32, 2)])
def test_the_fused_read_reads_what_the_dense_read_reads(monkeypatch, dtype, read):
    """(The search's floor from groups of 4 keys at R = 5, of a whole tile of 16 at R = 2.)"""
    q, keys, values, valid = case(dtype)
    want_out, want_lse = kept_read.top_kept_read(q, keys, values, valid, read, 0.3)
    monkeypatch.setattr(kept_read, "KERNEL", "fused")      # top_kept_read takes the kernel
    out, lse = kept_read.top_kept_read(q, keys, values, valid, read, 0.3)
    assert out.dtype == dtype and out.shape == want_out.shape and lse.dtype == torch.float32
    assert torch.isinf(lse[3]).all() and (out[3] == 0).all()      # no kept token: nothing read
    assert torch.isfinite(lse[:3]).all() and torch.isfinite(lse[4]).all()
    tol = 1e-6 if dtype == torch.float32 else 2e-3   # float16: the weights rounded, summed apart
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)
    # a query whose R-th and next scores tie (float16 has few) may read either key: not compared
    scores = torch.matmul(q, keys.transpose(-1, -2)).float().masked_fill(~valid[:, None, None], -math.inf)
    ranked = scores.sort(-1, descending=True).values
    tied = (ranked[..., read - 1] == ranked[..., read]) & torch.isfinite(ranked[..., read])
    assert tied.float().mean() < 0.01
    torch.testing.assert_close(out[~tied], want_out[~tied], rtol=tol, atol=tol)


def test_of_tied_keys_the_first_by_key_order_make_up_the_read():
    """Every key scores the same: exactly R of them are read (the log-sum-exp of R equal scores),
    the first R valid ones in key order, so the read is their values' mean; with the lane's
    valid keys fewer than R, all of them."""
    B, H, S, K, R = 2, 1, 3, 40, 6
    q = torch.ones(B, H, S, 16)
    keys = torch.full((B, H, K, 16), 0.25)
    values = torch.randn(B, H, K, 16, generator=torch.Generator().manual_seed(1))
    valid = torch.ones(B, K, dtype=torch.bool)
    valid[0, :10:2] = False                                        # lane 0: keys 1, 3, ... 9, 10, ...
    valid[1] = torch.arange(K) % 10 == 0                            # lane 1: 4 valid, fewer than R
    out, lse = kept_read_triton.fused_kept_read(q, keys, values, valid, R, 0.5)
    score = 16 * 0.25 * 0.5
    torch.testing.assert_close(lse[0], torch.full((H, S), score + math.log(R)))
    torch.testing.assert_close(lse[1], torch.full((H, S), score + math.log(4)))
    first = valid[0].nonzero()[:R, 0]
    torch.testing.assert_close(out[0], values[0][:, first].mean(1, keepdim=True).expand(H, S, 16))
    torch.testing.assert_close(out[1], values[1][:, valid[1]].mean(1, keepdim=True).expand(H, S, 16))


def test_inputs_the_kernel_does_not_take_are_named():
    q, keys, values, valid = case(torch.float32)
    with pytest.raises(ValueError, match="power-of-two head dims"):
        kept_read_triton.fused_kept_read(q[..., :12], keys[..., :12], values, valid, 5, 0.3)
    assert not kept_read_triton.supported(q.double(), values)
