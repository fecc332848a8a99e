"""The recurrent memory of ElephantLM (RMT, Bulatov et al. 2022): where its tokens sit in a chunk
framed as [read memory (n_mem) | tokens (T) | write slots (n_mem)], the gated update that turns
the write slots' output into the next chunk's read memory, the price of writing, and what a
document sees of the learned initial memory (the prefix of packed documents).

Functions of the model (its config, `mem_*` parameters and blocks): ElephantLM's methods
(`_memory_positions`, `_free_tokens`, `_memory_update`, `_write_cost`, `_prefix`) hand over to
them. Model.py's docstring tells the design.
"""
from __future__ import annotations

import torch
from torch import Tensor


def memory_positions(cfg, start: Tensor, end: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary positions (B, n_mem) of the read memory and of the write slots of a chunk whose
    tokens run from `start` to `end` - 1 (B,): -1 (not rotated) with mem_rotary "none"; the
    first and the last position with "chunk" and "free" (at a document's start: 0, the same
    as not rotated, so the initial memory's prefix holds for documents that start inside a
    chunk; with "free" only the memory's queries use them, see `free_tokens`)."""
    M = cfg.n_mem
    if cfg.mem_rotary == "none":
        none = torch.full((start.shape[0], M), -1, dtype=torch.long, device=start.device)
        return none, none
    return start[:, None].expand(-1, M), (end - 1)[:, None].expand(-1, M)


def free_tokens(cfg, M: int, T: int, device) -> Tensor | None:
    """With mem_rotary "free": which of [read memory (M) | tokens (T) | write slots (M)] are
    memory, the keys attention scores without rotary (Attention.forward's `free`); else None.
    The memory tokens keep the chunk's positions as queries (`memory_positions`): the
    write slots read the chunk from its last position."""
    if cfg.mem_rotary != "free" or not M:
        return None
    free = torch.ones(2 * M + T, dtype=torch.bool, device=device)
    free[M:M + T] = False
    return free


def memory_update(model, read: Tensor, written: Tensor) -> tuple[Tensor, Tensor | None]:
    """ElephantLM.update_memory (the formula is there), and the gates before the floor
    (B, n_mem) with their gradient (None for `replace`): mem_write_cost charges them. Sets
    `model.last_mem_gate` (the gates after the floor, detached) for analysis."""
    if model.cfg.mem_update == "replace":   # in the carried memory's dtype (residual "autocast")
        return written.to(read.dtype), None
    dtype = torch.promote_types(read.dtype, torch.float32)
    u = model.mem_norm(written.to(dtype))                               # (B, M, D)
    logit = (u * model.mem_gate.to(dtype)).sum(-1) + model.mem_gate_bias.to(dtype)  # (B, M)
    soft = torch.sigmoid(logit)
    g = soft
    floor = model.cfg.mem_gate_min
    if floor > 0:  # exact zero forward, sigmoid gradient (straight-through)
        g = soft + (torch.where(soft < floor, torch.zeros_like(soft), soft) - soft).detach()
    model.last_mem_gate = g.detach()
    read = read.to(dtype)
    return read + g.unsqueeze(-1) * (u - read), soft


def write_cost(model, gate: Tensor | None, T: int, reduction: str) -> Tensor | None:
    """The price of writing memory (mem_write_cost, training only: evaluation reports the
    cross-entropy alone): the mean gate per lane, charged for each of the chunk's T tokens;
    None without it."""
    if gate is None or not model.cfg.mem_write_cost or not model.training or reduction == "none":
        return None
    per_lane = gate.mean(-1)                                          # (B,)
    return model.cfg.mem_write_cost * (per_lane.sum() * T if reduction == "sum"
                                       else per_lane.mean())


def initial_prefix(model, dtype=None) -> list[tuple]:
    """ElephantLM.init_prefix's work (what it returns is told there): the blocks run over
    `mem_init` alone, one lane from a fresh state."""
    cfg = model.cfg
    x = model.mem_init.to(dtype or model.mem_init.dtype).unsqueeze(0)  # (1, M, D)
    pos = torch.full((1, cfg.n_mem), -1, dtype=torch.long, device=x.device)
    fresh = model.init_state(1, device=x.device, dtype=x.dtype)
    free = (torch.ones(cfg.n_mem, dtype=torch.bool, device=x.device)
            if cfg.mem_rotary == "free" else None)     # all memory
    out = []
    x0 = model.stack_input(x)
    for i, block in enumerate(model.blocks):
        if block.recurrent:   # Mamba-2, delta rule: (conv tail, recurrent state)
            x, (conv, ssm) = block(x, pos, (fresh.conv[i], fresh.ssm[i]))
            out.append((conv[0], ssm[0]))
        else:   # k: at position -1, i.e. before rotary, what `free` memory keys are too
            x, (k, v) = block(x, pos, None, free=free, x0=x0)
            out.append((k, v))
    return out
