"""Capturing a step as a CUDA graph: the one recipe that decoding (generate.Decoder) and streaming
evaluation (evaluate.StaticChunkStep) share."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor


def capture(step: Callable[[], object], state: Sequence[Tensor], warmup: int = 3):
    """Capture `step()` (which reads and writes static tensors in place) as a CUDA graph.

    It first runs `warmup` times on a side stream (whatever compiles or allocates lazily does it
    there, not in the capture), then once under capture; both change `state`, the tensors the step
    writes in place, so they are put back as they were before. Returns (graph, what the captured
    call returned: static outputs that every replay rewrites)."""
    keep = [t.clone() for t in state]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for t, old in zip(state, keep):
        t.copy_(old)
    return graph, out
