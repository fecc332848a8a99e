"""Compiling the chunk step: which of ElephantLM's functions torch.compile takes for each mode of
`ElephantLM.compile_for` (train.compile), in place and with parameter names unchanged, and the two
forms a compiled training step has (`TrainingGraphs`: CUDA graphs for steps with gradients, plain
for the rest). The options each compile passes (backend, inductor's options) are elephant.model's
`COMPILE_BACKEND` and `compile_kwargs`, which benchmarks adjust; they come here as `kwargs`.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

COMPILE_VARIANTS = 64   # graphs a compiled function may hold (see compile_chunk_steps)


def _limit_name(config) -> str:
    """dynamo's limit of graphs per function: recompile_limit (cache_size_limit, its older name, is
    an alias where both exist)."""
    return "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"


class TrainingGraphs:
    """A compiled function in two forms: `graphs` (CUDA graphs, torch.compile's reduce-overhead)
    for training steps with gradients, `plain` (compiled without graphs) for everything else. An
    evaluation or generation pass feeds each chunk the state the last one returned, which a CUDA
    graph's next replay would overwrite, and it runs between training steps: kept out of the
    training graphs, it neither needs that bookkeeping nor adds graphs of its own to their pool."""

    def __init__(self, model: nn.Module, graphs, plain):
        self.model, self.graphs, self.plain = model, graphs, plain

    def __call__(self, *args, **kwargs):
        training = self.model.training and torch.is_grad_enabled()
        return (self.graphs if training else self.plain)(*args, **kwargs)


def compile_chunk_steps(model: nn.Module, how: str, kwargs: Callable[[bool], dict]) -> None:
    """ElephantLM.compile_for's work (see there for the modes): torch.compile `model`'s chunk
    step in place. `kwargs(graphs)`: torch.compile's arguments, with CUDA graphs or without."""
    if how != "off":
        from elephant.layers.triton_env import register_ops
        register_ops()   # every kernel op registered before dynamo traces a call to it
        # static shapes: a graph per state structure, packed form (starts, the initial memory's
        # prefix, the varlen layout's room) and lane count (training, evaluation), more than
        # dynamo's default of 8 per function, past which it would run the rest uncompiled
        import torch._dynamo
        config = torch._dynamo.config
        name = _limit_name(config)
        setattr(config, name, max(COMPILE_VARIANTS, getattr(config, name)))
    # the varlen layout is shared between the chunk's attention layers by a dict they fill
    # (`_chunk`); a block compiled on its own would take it as an input and hold a graph for
    # it empty and one for it filled, so blocks each make their own
    model.share_layouts = how != "blocks"
    if how == "blocks":
        for block in model.blocks:
            block.compile(**kwargs(False))
    elif how in ("model", "graphs", "window"):
        # `_chunk`, not forward: forward keeps the detach and the memory-only path outside
        # the graph (see forward); the initial memory's prefix (packed documents) runs the
        # blocks outside forward
        names = ("_chunk", "init_prefix") + (("_window_chunks",) if how == "window" else ())
        for name in names:
            fn = getattr(model, name)
            plain = torch.compile(fn, **kwargs(False))
            if how in ("graphs", "window"):
                plain = TrainingGraphs(model, torch.compile(fn, **kwargs(True)), plain)
            setattr(model, name, plain)
    elif how != "off":
        raise ValueError(f"compile_for: expected blocks, model, graphs, window or off, "
                         f"got {how!r}")
