"""Checkpoints that are written atomically, resume exactly, and never unpickle anything.

A checkpoint is a folder `run_dir/checkpoints/step_NNNNNNN/`:
    model.safetensors   the weights (tied weights stored once), written by rank 0
    rankR.safetensors   each rank's tensors: its optimizer shard, its lanes' recurrent state, RNG
    rankR.json          the rest of that rank's state (batcher positions, counters) with the
                        structure that puts its tensors back in place
    meta.json           step, world size, the resolved config and the SHA-256 of every file
It is written under a temporary name and renamed into place, then `latest` (a text file naming
the folder) is replaced atomically; a killed writer leaves at most a `.tmp-*` folder that nothing
loads. Only the newest `keep` checkpoints are kept. Loading verifies the hashes and the config,
so a corrupt or foreign checkpoint is refused with a message instead of half-loaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model


class CheckpointError(ValueError):
    """A missing, corrupt or mismatched checkpoint; the message is for the user as it is."""


# ------------------------------------------------------------------ nested state <-> flat tensors
def flatten(obj, prefix: str, tensors: dict):
    """Replace every tensor of a nested dict/list by a reference into `tensors`; JSON for the rest."""
    if isinstance(obj, torch.Tensor):
        key = prefix
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {"__dict__": [[_key(k), flatten(v, f"{prefix}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)],
                "tuple": isinstance(obj, tuple)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} at {prefix} in a checkpoint")


def unflatten(obj, tensors: dict):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {_unkey(k): unflatten(v, tensors) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            items = [unflatten(v, tensors) for v in obj["__list__"]]
            return tuple(items) if obj.get("tuple") else items
    return obj


def _key(k):  # dict keys keep their type (optimizer states are keyed by int)
    return {"int": k} if isinstance(k, int) else k


def _unkey(k):
    return k["int"] if isinstance(k, dict) else k


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------ save / load
def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, rank_state: dict,
                    meta: dict, keep: int = 2, rank: int = 0, world: int = 1,
                    barrier=lambda: None) -> Path:
    """Write checkpoint `step`. Every rank calls this with its own `rank_state` (a nested dict of
    tensors and plain values: its optimizer shard, batcher positions, lane states, RNG); rank 0
    also writes the weights and `meta`, hashes everything and renames the folder into place."""
    root = Path(run_dir) / "checkpoints"
    name = f"step_{step:07d}"
    final, tmp = root / name, root / f".tmp-{name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    tensors: dict = {}
    structure = flatten(rank_state, "s", tensors)
    save_file(tensors, str(tmp / f"rank{rank}.safetensors"))
    (tmp / f"rank{rank}.json").write_text(json.dumps(structure))
    barrier()
    if rank == 0:
        save_model(model, str(tmp / "model.safetensors"))
        files = ["model.safetensors"] + [f"rank{r}.{ext}" for r in range(world)
                                         for ext in ("safetensors", "json")]
        meta = dict(meta, step=step, world_size=world, sha256={f: _sha256(tmp / f) for f in files})
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for f in tmp.iterdir():  # data on disk before the rename makes it visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = root / ".latest.tmp"
        latest_tmp.write_text(name + "\n")
        os.replace(latest_tmp, root / "latest")
        for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from itself, a run dir or a run's checkpoints dir (its `latest`)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if (path / "meta.json").is_file():
        return path
    for root in (path / "checkpoints", path):
        latest = root / "latest"
        if latest.is_file():
            ckpt = root / latest.read_text().strip()
            if (ckpt / "meta.json").is_file():
                return ckpt
            raise CheckpointError(f"{latest} names {ckpt.name}, which is missing or incomplete")
    raise CheckpointError(f"no checkpoint in {path} (expected meta.json, or checkpoints/latest)")


def read_meta(ckpt: Path) -> dict:
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt / 'meta.json'}: unreadable ({e})") from None
    if not isinstance(meta, dict) or "step" not in meta or "sha256" not in meta:
        raise CheckpointError(f"{ckpt / 'meta.json'}: not an elephant checkpoint")
    return meta


def load_checkpoint(ckpt: str | Path, model: torch.nn.Module | None = None, rank: int = 0,
                    verify: bool = True) -> tuple[dict, dict]:
    """Load weights into `model` (strictly) and return (meta, this rank's state) of a checkpoint."""
    ckpt = find_checkpoint(ckpt)
    meta = read_meta(ckpt)
    mine = ["model.safetensors", f"rank{rank}.safetensors", f"rank{rank}.json"]
    for f in mine:
        if f not in meta["sha256"] or not (ckpt / f).is_file():
            raise CheckpointError(f"{ckpt / f}: missing (written by {meta.get('world_size')} ranks)")
        if verify and _sha256(ckpt / f) != meta["sha256"][f]:
            raise CheckpointError(f"{ckpt / f}: corrupt (SHA-256 does not match meta.json)")
    if model is not None:
        try:
            missing, unexpected = load_model(model, str(ckpt / "model.safetensors"), strict=False,
                                             device=str(next(model.parameters()).device))
        except (SafetensorError, RuntimeError, OSError) as e:
            detail = [ln.strip() for ln in str(e).splitlines() if ln.strip()][1:2] or [str(e)]
            raise CheckpointError(f"{ckpt / 'model.safetensors'} does not fit this model: "
                                  f"{detail[0][:300]}") from None
        if missing or unexpected:
            raise CheckpointError(f"{ckpt / 'model.safetensors'} does not fit this model: missing "
                                  f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    try:
        tensors = load_file(str(ckpt / f"rank{rank}.safetensors"))
        structure = json.loads((ckpt / f"rank{rank}.json").read_text())
    except (SafetensorError, OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt}: rank {rank} state unreadable ({e})") from None
    return meta, unflatten(structure, tensors)
