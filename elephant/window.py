"""The BPTT window's forward: the chunks of one window in one call (`ElephantLM.forward_window`),
and its chunk steps after the checks (`window_chunks`, what compile_for("window") compiles as one
graph, through the model's `_window_chunks`). Functions of the model: they read its `_prepare`,
`_carried`, `_chunk` (the class's own, never a compiled one), `_output`, `head_loss` and
`_write_cost`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .state import RecurrentState


def forward_window(model, chunks: list[dict], state: RecurrentState | None = None,
                   reduction: str = "sum") -> tuple[Tensor, RecurrentState]:
    """The chunks of one BPTT window in one call: for each in turn what `forward(**chunk,
    reduction=reduction)` does, with the state carried from one to the next; returns the sum
    of their losses and the state after the last. Each chunk is a dict of forward's
    arguments: tokens, targets (both required), reset, loss_mask, starts, inner_starts.

    compile_for("window") compiles the chunks' steps (`_window_chunks`) as one graph, so that
    the window's backward is one graph too: each weight's gradient is summed over the
    chunks inside it, not by an addition of its own after them. The losses run after it, as
    in `forward`: a summed loss as one pass of the head over the chunks stacked as lanes, a
    mean chunk by chunk. A state that tracks the memory-only path goes chunk by chunk
    through `forward`."""
    if not chunks:
        raise ValueError("forward_window: no chunk given")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"forward_window: reduction must be sum or mean, got {reduction!r}")
    if state is not None and state.memory_path is not None:
        loss = 0.0
        for chunk in chunks:
            nll, state = model(state=state, reduction=reduction, **chunk)
            loss = loss + nll
        return loss, state
    tokens, resets, starts, rooms = [], [], [], []
    for chunk in chunks:
        if "tokens" in chunk and chunk["tokens"].shape != chunks[0]["tokens"].shape:
            raise ValueError(f"forward_window: every chunk of a window has the same (lanes, "
                             f"length): {tuple(chunks[0]['tokens'].shape)} then "
                             f"{tuple(chunk['tokens'].shape)}")
        extra = set(chunk) - {"tokens", "targets", "reset", "loss_mask", "starts", "inner_starts"}
        missing = {"tokens", "targets"} - set(chunk)
        if extra or missing:
            raise ValueError(f"forward_window: a chunk needs tokens and targets, and takes "
                             f"reset, loss_mask, starts and inner_starts; got unknown keys "
                             f"{sorted(extra)}, missing {sorted(missing)}")
        # (a fresh state for the first chunk when none is given, the same one after it)
        state, reset, start, room = model._prepare(chunk["tokens"], state, chunk.get("reset"),
                                                  chunk.get("starts"), chunk.get("inner_starts"))
        tokens.append(chunk["tokens"])
        resets.append(reset)
        starts.append(start)
        rooms.append(room)
    (h, gates), state = model._window_chunks(tokens, state, resets, starts, rooms)
    T = h.shape[1]
    if reduction == "mean":
        loss = 0.0
        for h_c, gate, chunk in zip(h.chunk(len(chunks)), gates, chunks):
            loss = loss + model._output(h_c, gate, chunk["targets"], chunk.get("loss_mask"),
                                       reduction)
        return loss, state
    # the summed loss as one head pass over the window's chunks stacked as lanes (the sum over
    # all their tokens is the sum of the chunks' sums): the head's work on its whole (V, D)
    # weight (the cast to the matmul dtype, the scaling of the float32 gradient, the sum of
    # the chunks' gradients) is done once a window, not once a chunk
    masks = [chunk.get("loss_mask") for chunk in chunks]
    mask = None
    if any(m is not None for m in masks):
        mask = torch.cat([torch.ones(chunk["targets"].shape, dtype=torch.bool, device=h.device)
                          if m is None else m for m, chunk in zip(masks, chunks)])
    loss = model.head_loss(h, torch.cat([chunk["targets"] for chunk in chunks]), mask, reduction)
    for gate in gates:
        cost = model._write_cost(gate, T, reduction)
        loss = loss if cost is None else loss + cost
    return loss, state

def window_chunks(model, tokens: list, state: RecurrentState, resets: list, starts: list,
                  rooms: list) -> tuple[tuple, RecurrentState]:
    """forward_window's chunks after its checks: for each, forward's detach and `_chunk`
    (the class's own, never a compiled one), the initial memory's prefix computed by the
    first chunk that needs it and handed to the later ones. Returns ((the chunks' final
    normalized hidden states stacked as lanes (k B, T, D), [the memory gates or None a chunk]),
    the state after the last). What compile_for("window") compiles (inside its graph the
    stacking is where the final norm writes)."""
    hs, gates = [], []
    # the window's tokens embedded by one lookup: its backward is one scatter of every
    # chunk's gradient into one (V, D) buffer, where a lookup a chunk made a buffer each and
    # then summed them (passes over the whole embedding's size)
    embedded = model.embed(torch.cat(tokens)).chunk(len(tokens))
    for tok, reset, start, room, emb in zip(tokens, resets, starts, rooms, embedded):
        state, core = model._carried(state)
        h, new, _, _, gate, used = type(model)._chunk(model, tok, core, reset, start, state.prefix,
                                                      False, room, emb)
        new.links = state.links
        new.prefix = used if used is not None else state.prefix
        hs.append(h)
        gates.append(gate)
        state = new
    return (hs[0] if len(hs) == 1 else torch.cat(hs), gates), state
