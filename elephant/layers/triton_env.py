"""What the Triton kernel modules (layers' ssd, elephant, ce, conv and rotary kernels, optim's
gram kernel) share: Triton itself when it imports (None and HAS_TRITON False when it does not:
the plain paths run instead), whether its interpreter runs the kernels on CPU tensors
(TRITON_INTERPRET=1: the tests), and the float dtypes whose math the kernels do in float32."""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    triton = tl = None
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    """t (..., D) as (N, D) rows with unit stride over D: a view where t's strides allow it (e.g. a
    column slice of a wider projection output), else a contiguous copy. Row kernels read it at
    its row stride."""
    r = t.reshape(-1, t.shape[-1])
    return r if r.stride(1) == 1 else r.contiguous()
