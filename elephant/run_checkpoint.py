"""A training run's checkpoint: what the trainer saves at a step and how it resumes exactly.

    save_run(trainer) -> the step folder written
    resume_run(trainer)   the trainer's model, optimizers, lanes' state, batchers, RNG and counters
                          back from the newest checkpoint that verifies

The files, their hashes and their atomic writing are checkpoint.py's; this module decides what a
trainer's step consists of. Every rank writes its own slice (optimizer shards, its lanes' state and
batchers); rank 0 picks the checkpoint to resume from and every rank loads that one. The
functions take the trainer (elephant/trainer.py's Trainer) as `self` and never import it: the
trainer imports this module, and dependencies point one way.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from .checkpoint import (CheckpointError, check_model_config, load_checkpoint,
                         newest_intact_checkpoint, read_meta, save_checkpoint, set_aside, set_latest)


def save_run(self) -> Path:
    """Write the checkpoint of the trainer `self` at its step (no-op when this step is saved)."""
    ckpt = self.run_dir / "checkpoints" / f"step_{self.step:07d}"
    if self.saved_step == self.step:  # e.g. a resumed run that was already complete
        return ckpt
    rank_state = {
        "optim": self.opt.state_dict(),
        "states": [s.state_dict() for s in self.states],
        "batchers": [b.state_dict() for b in self.batchers],
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if self.rt.device.type == "cuda" else None},
    }
    meta = {"config": self.cfg.to_dict(), "tokenizer": self.tokenizer.fingerprint,
            "bad_steps": self.bad_steps,
            "skipped_steps": self.skipped_steps, "tokens_seen": self.tokens_seen,
            "grad_accum": self.cfg.train.grad_accum}
    save_checkpoint(self.run_dir, self.step, self.model, rank_state, meta,
                    keep=self.cfg.train.keep_ckpts, rank=self.rt.rank, world=self.rt.world,
                    all_ok=lambda ok: bool(self._agree(int(ok), "min")))
    self.saved_step = self.step
    return ckpt

def resume_run(self) -> None:
    """Continue the trainer `self` from the newest intact checkpoint of its run dir: rank 0 picks
    it (setting broken newer ones aside, with a message) and every rank loads that one."""
    found, error, skipped = None, None, []
    if self.rt.main:
        try:
            found, skipped = newest_intact_checkpoint(self.run_dir)
            for bad, why in skipped:
                print(f"skipped checkpoint {bad.name}: {why}; moved it to "
                      f"{set_aside(bad).name}", file=sys.stderr)
            latest = found.parent / "latest"
            if skipped or not latest.is_file() or latest.read_text().strip() != found.name:
                # it may have named one of them, or be one behind (a kill between the rename
                # of the newest folder and the update of `latest`): a resume that has nothing
                # left to train saves nothing, so `latest` must be right from here on
                set_latest(found)
        except CheckpointError as e:
            error = e
        except OSError as e:
            error = CheckpointError(f"{e.filename}: {e.strerror} (setting a broken checkpoint "
                                    f"aside)")
    step = self._agree(read_meta(found)["step"] if found else -1, "max")
    if error is not None:
        raise error
    if step < 0:
        raise CheckpointError(f"{self.run_dir}: rank 0 found no checkpoint to resume from "
                              f"(see its message)")
    ckpt = self.run_dir / "checkpoints" / f"step_{step:07d}"
    meta = read_meta(ckpt)
    check_model_config(meta, self.cfg.model.to_dict(), str(ckpt),
                       "resume with the same model.* settings")
    if meta["world_size"] != self.rt.world or meta["grad_accum"] != self.cfg.train.grad_accum:
        raise CheckpointError(f"{ckpt}: written with world_size={meta['world_size']} and "
                              f"grad_accum={meta['grad_accum']}; resume with the same")
    # rank 0 has just verified every file of it
    meta, state = load_checkpoint(ckpt, self.model, rank=self.rt.rank, verify=not self.rt.main)
    self.opt.load_state_dict(state["optim"])
    for b, sd in zip(self.batchers, state["batchers"]):
        b.load_state_dict(sd)
    self.iters = [iter(b) for b in self.batchers]
    for s, sd in zip(self.states, state["states"]):
        s.load_state_dict(sd)
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] is not None and self.rt.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    self.step = meta["step"]
    self.bad_steps, self.skipped_steps = meta["bad_steps"], meta["skipped_steps"]
    self.tokens_seen = meta["tokens_seen"]
    self.saved_step = self.step
    self.resume_record = {"kind": "resumed", "step": self.step, "checkpoint": str(ckpt),
                          "skipped": [{"checkpoint": str(p), "why": why} for p, why in skipped]}
    if self.rt.main:
        print(f"resumed from {ckpt} at step {self.step}", file=sys.stderr)
