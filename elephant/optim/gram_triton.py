"""Triton kernel for the symmetric products of the orthogonalizers, held equal to `gram_reference`.

Every quintic iteration forms two symmetric matrices: the Gram matrix A = X X^T and B = b A + c A A
(A A = A A^T because A is symmetric). A symmetric product needs only the tiles on and above the
diagonal: each program computes one tile (i, j), i <= j, and stores it at (i, j) and transposed at
(j, i), so half the tiles (about half the FLOPs) are skipped. One kernel serves both products:

    C = alpha * X X^T + beta * X          (beta only for square symmetric X, i.e. B from A)

X may be any strided view, so the tall case X^T X passes X.mT without a copy. Products accumulate
in float32, the output has X's dtype. Whether this beats cuBLAS (which computes both triangles)
on the 70M model's shapes is measured by benchmarks/bench_optim.py; Muon uses torch.matmul unless
asked for gram="triton". The other product of an iteration, aX + BX, is a plain matmul with an
epilogue, which torch.baddbmm (cuBLAS, beta) already does in one kernel.

Imports without CUDA or Triton; under TRITON_INTERPRET=1 the kernel runs on CPU tensors (tests).
"""
from __future__ import annotations

import torch
from torch import Tensor

from elephant.layers.triton_env import FLOAT_DTYPES
from elephant.layers.triton_env import HAS_TRITON as HAVE_TRITON
from elephant.layers.triton_env import INTERPRET as _INTERPRET
from elephant.layers.triton_env import tl, triton


def gram_reference(X: Tensor, alpha: float = 1.0, beta: float = 0.0) -> Tensor:
    """alpha * X X^T + beta * X for X (B, M, K) (beta != 0 needs M == K)."""
    if beta != 0.0:
        return torch.baddbmm(X, X, X.mT, beta=beta, alpha=alpha)
    return torch.bmm(X, X.mT) * alpha if alpha != 1.0 else torch.bmm(X, X.mT)


def supports(X: Tensor) -> bool:
    return HAVE_TRITON and (X.is_cuda or _INTERPRET) and X.ndim == 3 and X.dtype in FLOAT_DTYPES


if HAVE_TRITON:

    _CONFIGS = ([triton.Config({"BLOCK": 16, "BLOCK_K": 16}, num_warps=1)] if _INTERPRET else [
        triton.Config({"BLOCK": b, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for b, k, w, s in [(64, 64, 4, 4), (128, 64, 8, 3), (128, 32, 8, 4), (64, 128, 4, 3),
                           (128, 64, 4, 4)]])

    @triton.jit
    def _acc_k_block(acc, x_ptr, rows_i, rows_j, k0, M, K, sxm, sxk, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """acc += X[rows_i, k0:k0+BLOCK_K] @ X[rows_j, k0:k0+BLOCK_K]^T. UPCAST (interpreter only:
        its tl.dot multiplies bf16 bit patterns as integers) converts the tiles to float32 first.
        IEEE: full fp32 products for fp32 input (tl.dot would use TF32)."""
        kk = k0 + tl.arange(0, BLOCK_K)
        xi = tl.load(x_ptr + rows_i[:, None] * sxm + kk[None, :] * sxk,
                     mask=(rows_i[:, None] < M) & (kk[None, :] < K), other=0.0)   # (BLOCK, BLOCK_K)
        xj = tl.load(x_ptr + kk[:, None] * sxk + rows_j[None, :] * sxm,
                     mask=(kk[:, None] < K) & (rows_j[None, :] < M), other=0.0)   # (BLOCK_K, BLOCK)
        if UPCAST:
            xi = xi.to(tl.float32)
            xj = xj.to(tl.float32)
        if IEEE:
            return tl.dot(xi, xj, acc, input_precision="ieee")
        else:
            return tl.dot(xi, xj, acc)

    @triton.autotune(configs=_CONFIGS, key=["M", "K", "sxm", "sxk", "ADD_X", "IEEE"])
    @triton.jit
    def _sym_gram_kernel(x_ptr, c_ptr, M, K,
                         sxb, sxm, sxk, scb, scm, scn,
                         alpha, beta,
                         ADD_X: tl.constexpr, INTERPRET: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
        tiles = tl.cdiv(M, BLOCK)
        pid = tl.program_id(0)
        ti = pid // tiles
        tj = pid % tiles
        if ti > tj:          # below the diagonal: the mirror of tile (tj, ti)
            return
        b = tl.program_id(1)
        x_ptr += b * sxb
        c_ptr += b * scb
        rows_i = ti * BLOCK + tl.arange(0, BLOCK)
        rows_j = tj * BLOCK + tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        if INTERPRET:    # the interpreter cannot take range() over a runtime argument
            k0 = 0
            while k0 < K:
                acc = _acc_k_block(acc, x_ptr, rows_i, rows_j, k0, M, K, sxm, sxk, BLOCK_K,
                                   INTERPRET, IEEE)
                k0 += BLOCK_K
        else:            # a for loop, which the compiler software-pipelines (num_stages)
            for k0 in range(0, K, BLOCK_K):
                acc = _acc_k_block(acc, x_ptr, rows_i, rows_j, k0, M, K, sxm, sxk, BLOCK_K,
                                   INTERPRET, IEEE)
        acc = acc * alpha
        if ADD_X:            # square symmetric X: + beta * X[i-tile, j-tile]
            xij = tl.load(x_ptr + rows_i[:, None] * sxm + rows_j[None, :] * sxk,
                          mask=(rows_i[:, None] < M) & (rows_j[None, :] < M), other=0.0)
            acc += beta * xij.to(tl.float32)
        out = acc.to(c_ptr.dtype.element_ty)
        mask = (rows_i[:, None] < M) & (rows_j[None, :] < M)
        tl.store(c_ptr + rows_i[:, None] * scm + rows_j[None, :] * scn, out, mask=mask)
        if ti != tj:
            mask_t = (rows_j[:, None] < M) & (rows_i[None, :] < M)
            tl.store(c_ptr + rows_j[:, None] * scm + rows_i[None, :] * scn, tl.trans(out), mask=mask_t)


def sym_gram(X: Tensor, alpha: float = 1.0, beta: float = 0.0, out: Tensor | None = None) -> Tensor:
    """alpha * X X^T + beta * X for X (B, M, K), any strides (beta != 0 needs square symmetric X)."""
    if not supports(X):
        raise RuntimeError("sym_gram needs Triton and a CUDA tensor (or TRITON_INTERPRET=1) of "
                           f"shape (B, M, K) in bf16/fp16/fp32, got {X.device} {tuple(X.shape)} {X.dtype}")
    Bn, M, K = X.shape
    add_x = beta != 0.0
    if add_x and M != K:
        raise ValueError(f"sym_gram: beta * X needs a square X, got {tuple(X.shape)}")
    if out is None:
        out = torch.empty(Bn, M, M, device=X.device, dtype=X.dtype)

    def grid(meta):
        t = triton.cdiv(M, meta["BLOCK"])
        return (t * t, Bn)

    _sym_gram_kernel[grid](X, out, M, K, *X.stride(), *out.stride(), float(alpha), float(beta),
                           ADD_X=add_x, INTERPRET=_INTERPRET,
                           IEEE=X.dtype == torch.float32)
    return out
