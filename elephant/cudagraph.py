"""Capturing a step as a CUDA graph: the one recipe that decoding (generate.Decoder) and streaming
evaluation (evaluate.StaticChunkStep) share."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor


_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def kept_stream(device=None, priority: int = 0) -> torch.cuda.Stream:
    """A side stream of `device` (default the current one) and `priority`, made once a process.
    A stream that runs a matrix product gets a matmul-library workspace of its own that torch keeps
    until the process ends (32 MiB on an H100), so a stream made anew for each capture or pass
    leaks that much every time: evaluation passes made 4-6 and kept 128-192 MiB more each
    (H100, 2026-11-27)."""
    index = torch.cuda.current_device() if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    key = (index, priority)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=index, priority=priority)
    return _STREAMS[key]


def capture(step: Callable[[], object], state: Sequence[Tensor], warmup: int = 3,
            error_mode: str = "global", stream: torch.cuda.Stream | None = None,
            lean: bool = False):
    """Capture `step()` (which reads and writes static tensors in place) as a CUDA graph.

    It first runs `warmup` times on a side stream (whatever compiles or allocates lazily does it
    there, not in the capture), then once under capture; both change `state`, the tensors the step
    writes in place, so they are put back as they were before. `error_mode`: CUDA's capture mode;
    "thread_local" where other threads go on using CUDA meanwhile (a process group's watchdog
    polls its collectives' events), as torch.compile's CUDA graphs capture. `stream`: the stream
    to capture on (its priority goes into the graph's kernels; None: the kept side stream the
    warm-up runs on, `kept_stream()`).
    lean: begin the capture on that stream after an event wait, where torch.cuda.graph's context
    first synchronizes the device and empties the caching allocator's cache and the pinned host
    memory's. A pass that captures a step while other work runs (evaluation's side batch and
    compacted batches) then neither stalls for the device nor allocates again, through the driver,
    the memory it has just given back (the graph takes a memory pool of its own either way).
    Returns (graph, what the captured call returned: static outputs that every replay rewrites)."""
    keep = [t.clone() for t in state]
    side = kept_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if lean:
        on = stream if stream is not None else side
        on.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(on):
            graph.capture_begin(capture_error_mode=error_mode)
            try:
                out = step()
            except BaseException:
                try:   # end the broken capture, so that the stream can be used again
                    graph.capture_end()
                except Exception:
                    pass
                raise
            graph.capture_end()
    else:
        with torch.cuda.graph(graph, stream=stream, capture_error_mode=error_mode):
            out = step()
    for t, old in zip(state, keep):
        t.copy_(old)
    return graph, out
