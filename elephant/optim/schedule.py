"""Per-step multipliers: the trainer asks for them by step number and hands them to the optimizers.

`Optimizers.set_step(step, total_steps)` applies all three; the functions are separate so that
they can be plotted and tested. `step` counts optimizer steps from 0 to total_steps - 1.

lr:  linear warm-up over `warmup_steps` (step 0 already gets 1 / warmup_steps, never 0), then flat,
     then a decay to `min_lr_frac` over the last `cooldown_frac` of the steps after warm-up
     (cooldown_frac 1: decay all the way; 0.2: the last 20%, "warmup-stable-decay").
     schedule = constant | linear | cosine names the decay's shape (constant: none).
wd:  "lr" follows the lr multiplier (classic AdamW: decay per step = lr * wd); "constant" stays 1;
     "linear" and "cosine" go from 1 to 0 over the whole run on their own, whatever the lr does.
Muon momentum: linear from `momentum_warmup_from` to `momentum` over `momentum_warmup_steps`.
"""
from __future__ import annotations

import math


def _decay(progress: float, shape: str) -> float:
    """1 at progress 0, 0 at progress 1."""
    progress = min(1.0, max(0.0, progress))
    if shape == "linear":
        return 1.0 - progress
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "constant":
        return 1.0
    raise ValueError(f"schedule: expected constant, linear or cosine, got {shape!r}")


def lr_multiplier(step: int, total_steps: int, cfg) -> float:
    """Multiplier on every group's base lr at optimizer step `step` (0-based)."""
    warmup = cfg.warmup_steps
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    decay_steps = cfg.cooldown_frac * max(0, total_steps - warmup)
    if cfg.schedule == "constant" or decay_steps <= 0:
        return 1.0
    start = total_steps - decay_steps
    floor = cfg.min_lr_frac
    return floor + (1.0 - floor) * _decay((step - start) / decay_steps, cfg.schedule)


def wd_multiplier(step: int, total_steps: int, cfg) -> float:
    """Multiplier on the weight decay at step `step` (see the module doc for wd_schedule)."""
    if cfg.wd_schedule == "lr":
        return lr_multiplier(step, total_steps, cfg)
    return _decay(step / max(1, total_steps), cfg.wd_schedule)


def muon_momentum(step: int, cfg) -> float:
    """Muon's momentum at step `step`: warm-up from momentum_warmup_from to momentum."""
    n = cfg.momentum_warmup_steps
    if n <= 0:
        return cfg.momentum
    frac = min(1.0, step / n)
    return cfg.momentum_warmup_from + frac * (cfg.momentum - cfg.momentum_warmup_from)
