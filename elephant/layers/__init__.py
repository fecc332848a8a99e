"""The model's layers: attention, the Mamba-2 mixer and its SSD scan, the gated delta rule mixer,
the elephant MLP, the head."""
from __future__ import annotations

import torch

# Inside a compiled graph, a call on at most this many tokens takes the plain PyTorch path, which
# the compiler fuses into the graph, instead of a custom op (Triton SSD scan, fused elephant MLP):
# each custom op call costs ~0.3-1 ms of host time (its launch glue, forward and backward) against
# microseconds of GPU work at that size. The initial memory's prefix of packed documents (n_mem
# tokens, one lane, once per step) was ~10 ms of host time per step through them (H100 profile,
# docs/RESULTS.md, packing).
INLINE_MAX_TOKENS = 32


def inline_in_graph(x: torch.Tensor, tokens: int) -> bool:
    """Whether a CUDA call on `tokens` tokens (batch x length) should take the plain path because
    it is being compiled into a graph and is too small for a custom op to pay its host cost."""
    return x.is_cuda and tokens <= INLINE_MAX_TOKENS and torch.compiler.is_compiling()
