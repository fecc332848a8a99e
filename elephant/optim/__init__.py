"""Optimizers: Muon (Newton-Schulz / Polar Express / AOL, NorMuon, cautious weight decay) for
hidden matrices, Adam for the rest, sharded over ranks when a process group exists.

The trainer uses `build_optimizers(model, cfg.optim)` and the returned `Optimizers` object
(see build.py for the per-step protocol) and nothing else.
"""
from .adam import Adam
from .build import Optimizers, assign_parameters, build_optimizers
from .dist import ShardLayout, world
from .muon import (Muon, aol_polar_express, muon_lr_scale, newton_schulz, normuon_, orthogonalize,
                   polar_express, polar_express_coefficients)
from .schedule import lr_multiplier, muon_momentum, wd_multiplier

__all__ = ["Adam", "Muon", "Optimizers", "ShardLayout", "aol_polar_express", "assign_parameters",
           "build_optimizers", "lr_multiplier", "muon_lr_scale", "muon_momentum", "newton_schulz",
           "normuon_", "orthogonalize", "polar_express", "polar_express_coefficients",
           "wd_multiplier", "world"]
