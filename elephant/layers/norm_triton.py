"""The backward of the Mamba block's gated RMSNorm as one Triton kernel.

    gated_rmsnorm(y, z, weight, eps) = rmsnorm(y * silu(z)) * weight      (float32 math, y's dtype)

The forward stays PyTorch ops (inductor fuses it at the memory's bandwidth). Its backward, left to
inductor, wrote dLoss/d(y * silu(z)) as a float32 tensor of the whole chunk (the kernel that
reduces the weight's gradient over the rows could not also take the two products after it), then
read it back twice: once for y's gradient, once for z's, each a kernel of its own. At the wt103-70m
shape (32 x 528 tokens, 1,024 channels) those three passes took ~200 us a Mamba layer's chunk,
where the bytes (read dout, y, z; write dy, dz) take ~60 (this kernel: ~87, LAUNCH). Here one
program walks blocks of rows:
it recomputes y * silu(z) and its RMS from y and z, writes dy and dz in their dtypes, and piles the
weight's gradient up in registers (one float32 row of partial sums a program, summed by torch).

    d(out)/.. with g = dout * weight, h = y * silu(z), r = 1 / sqrt(mean(h^2) + eps), hn = h * r:
    dh = r * (g - hn * mean(g * hn));  dy = dh * silu(z);  dz = dh * y * silu'(z);
    dweight = sum over rows of dout * hn

Registered as two torch.library.triton_op (the forward's PyTorch ops, which a compiled graph
traces and fuses, and the backward's kernel, which inductor launches inside a compiled chunk),
joined by register_autograd. (A torch.autograd.Function around the same backward op compiled
wrongly in float32 on torch 2.11: inductor moved the backward into the forward graph with a zero
output gradient, and every gradient came out zero; bf16 was right.)
Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .triton_env import FLOAT_DTYPES as _DTYPES
from .triton_env import HAS_TRITON, tl, triton
from .triton_env import INTERPRET as _INTERPRET
from .triton_env import register_autograd, triton_op
from .triton_env import unit_stride_rows

# (rows a program takes at once, warps, programs per SM) of the backward on the GPU: a (ROWS, D)
# tile of each tensor at a time, the programs walking the row blocks in turn. Set from
# benchmarks/kernels.py gated-norm (H100, the recipe's 32 x 528 x 1,024 bf16 rows, 2026-11-26):
# 87.2 us at (2, 4, 4), 92.2 at (4, 4, 4), the 18 launches swept all within 87-98 us. Alone, with
# nothing after it, inductor's compiled backward of the same ops is faster (82.6 us, one kernel);
# what this kernel wins is in the training step, where inductor split that backward in three
# passes around the in-projection's gradient (see the module docstring).
LAUNCH = (2, 4, 4)


def supported(y: Tensor, z: Tensor) -> bool:
    """Whether the kernel takes these (CUDA, or CPU under the interpreter; float dtypes whose math
    is float32; rows of at most 8,192 channels, each held whole by a program)."""
    return (HAS_TRITON and (y.is_cuda or _INTERPRET) and y.dtype in _DTYPES and z.dtype in _DTYPES
            and y.shape == z.shape and 0 < y.shape[-1] <= 8192)


def reference(y: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """rmsnorm(y * silu(z)) * weight in float32 (float64 for float64 inputs), in y's dtype."""
    dtype = torch.promote_types(y.dtype, torch.float32)
    h = y.to(dtype) * F.silu(z.to(dtype))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.to(dtype)).to(y.dtype)


if HAS_TRITON:
    @triton.jit
    def _gated_norm_bwd_kernel(dout_ptr, y_ptr, z_ptr, w_ptr, dy_ptr, dz_ptr, dw_ptr, N, D, s_do,
                               s_y, s_z, s_dz, eps, ITERS: tl.constexpr, ROWS: tl.constexpr,
                               BD: tl.constexpr):
        """Row blocks pid, pid + P, ... of (N, D) (ITERS of them, a constant of the kernel; those
        past N masked), rows at strides s_*, unit stride over D; dy contiguous, dz's rows at
        stride s_dz (the first columns of a wider gradient: `backward_into`). This program's
        partial sums of the weight's gradient to dw_ptr[pid]."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        cols = tl.arange(0, BD)[None, :]
        cm = cols < D
        w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)          # (1, BD)
        dw = tl.zeros([ROWS, BD], dtype=tl.float32)
        for it in range(ITERS):
            blk = pid + it * nprog
            rows = (blk * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]    # (ROWS, 1)
            m = (rows < N) & cm
            do = tl.load(dout_ptr + rows * s_do + cols, mask=m, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + rows * s_y + cols, mask=m, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + rows * s_z + cols, mask=m, other=0.0).to(tl.float32)
            s = tl.sigmoid(z)
            sz = z * s
            h = y * sz
            # (inductor passes eps as a float64 scalar: the rows' RMS back to float32 at once)
            r = tl.rsqrt(tl.sum(h * h, axis=1) / D + eps).to(tl.float32)[:, None]   # (ROWS, 1)
            hn = h * r
            g = do * w
            dw += do * hn
            dh = r * (g - hn * (tl.sum(g * hn, axis=1) / D)[:, None])
            tl.store(dy_ptr + rows * D + cols, (dh * sz).to(dy_ptr.dtype.element_ty), mask=m)
            tl.store(dz_ptr + rows * s_dz + cols,
                     (dh * y * s * (1.0 + z * (1.0 - s))).to(dz_ptr.dtype.element_ty), mask=m)
        tl.store(dw_ptr + pid * D + cols, tl.sum(dw, axis=0)[None, :], mask=cm)


def _programs(x: Tensor, blocks: int, per_sm: int) -> int:
    if x.is_cuda:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        return max(1, min(blocks, per_sm * sms))
    return max(1, min(blocks, 4))   # the interpreter: a few programs, each walking several blocks


@triton_op("elephant::gated_rmsnorm_backward", mutates_args=())
def _bwd_op(dout: Tensor, y: Tensor, z: Tensor, weight: Tensor, eps: float
            ) -> tuple[Tensor, Tensor, Tensor]:
    dz = torch.empty(z.shape, device=z.device, dtype=z.dtype)
    dy, dw = backward_into(dout, y, z, weight, eps, dz)
    return dy, dz, dw


def backward_into(dout: Tensor, y: Tensor, z: Tensor, weight: Tensor, eps: float, into: Tensor
                  ) -> tuple[Tensor, Tensor]:
    """The backward's kernel: (dy, dweight), with dz written to `into`, a tensor of z's leading
    shape whose rows (contiguous, unit stride over columns) hold dz in their first D columns (z's
    own gradient, or the first column block of a wider one: the Mamba block's in-projection's,
    `mamba_inner`). float32 weight."""
    D = y.shape[-1]
    do, yr, zr = unit_stride_rows(dout), unit_stride_rows(y), unit_stride_rows(z)
    N = yr.shape[0]
    dz = into.view(N, into.shape[-1])
    dy = torch.empty(y.shape, device=y.device, dtype=y.dtype)
    rows, warps, per_sm = (4, 1, 1) if _INTERPRET else LAUNCH
    P = _programs(y, triton.cdiv(N, rows), per_sm) if N else 1
    dw = torch.zeros(P, D, device=y.device, dtype=torch.float32)
    if N:
        torch.library.wrap_triton(_gated_norm_bwd_kernel)[(P,)](
            do, yr, zr, weight, dy, into, dw, N, D, do.stride(0), yr.stride(0), zr.stride(0),
            dz.stride(0), eps, ITERS=triton.cdiv(triton.cdiv(N, rows), P), ROWS=rows,
            BD=triton.next_power_of_2(D), num_warps=warps)
    return dy, dw.sum(0)


@triton_op("elephant::gated_rmsnorm", mutates_args=())
def _fwd_op(y: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The forward: PyTorch ops only, which a compiled graph traces and fuses."""
    return reference(y, z, weight, eps)


def _setup(ctx, inputs, output):
    y, z, weight, eps = inputs
    ctx.save_for_backward(y, z, weight)
    ctx.eps = eps


def _grad(ctx, dout):
    y, z, weight = ctx.saved_tensors
    dy, dz, dw = _bwd_op(dout, y, z, weight.float(), ctx.eps)
    return dy, dz, dw.to(weight.dtype), None


register_autograd(_fwd_op, _grad, setup_context=_setup)


def gated_rmsnorm(y: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """rmsnorm(y * silu(z)) * weight (see the module docstring); y, z (..., D) of one shape, any
    strides with unit stride over D; weight (D,). The backward is the Triton kernel."""
    if y.shape != z.shape or y.shape[-1] != weight.shape[0]:
        raise ValueError(f"gated_rmsnorm: y {tuple(y.shape)}, z {tuple(z.shape)} and weight "
                         f"{tuple(weight.shape)} do not match")
    return _fwd_op(y, z, weight, float(eps))
