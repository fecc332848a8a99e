"""Checkpoints that are written atomically, resume exactly, and never unpickle anything.

A checkpoint is a folder `run_dir/checkpoints/step_NNNNNNN/`:
    model.safetensors   the weights (tied weights stored once), written by rank 0
    rankR.safetensors   each rank's tensors: its optimizer shard, its lanes' recurrent state, RNG
    rankR.json          the rest of that rank's state (batcher positions, counters) with the
                        structure that puts its tensors back in place
    meta.json           step, world size, the resolved config and the SHA-256 of every file
It is written under a temporary name, flushed to disk and renamed into place, then `latest` (a
text file naming the folder) is replaced atomically: a killed writer leaves at most a `.tmp-*`
folder that nothing loads (the next save removes it), and a write that fails (a full disk) removes
its temporary folder and leaves the earlier checkpoints and `latest` as they were. Only the newest
`keep` checkpoints are kept. Loading verifies the hashes and the config, so a corrupt or foreign
checkpoint is refused with a message instead of half-loaded; a resume, and every reader of a run
dir (eval, generation, export: `checkpoint_to_read`), starts from the newest checkpoint that
verifies (`newest_intact_checkpoint`), whatever `latest` says, and names those it skipped.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from .fsutil import atomic_write_text, fsync_dir, write_synced


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
                    all_ok: Callable[[bool], bool] = lambda ok: ok) -> Path:
    """Write checkpoint `step`. Every rank calls this with its own `rank_state` (a nested dict of
    tensors and plain values: its optimizer shard, batcher positions, lane states, RNG); rank 0
    also writes the weights and `meta`, hashes everything and renames the folder into place.

    `all_ok(ok)` tells whether every rank's `ok` is true (a collective, so it is a barrier too).
    A write that fails on any rank (a full disk) raises CheckpointError on every rank and leaves
    the checkpoints before this one and `latest` as they were; the temporary folder is removed."""
    root = Path(run_dir) / "checkpoints"
    name = f"step_{step:07d}"
    final, tmp = root / name, root / f".tmp-{name}"

    def stage(fn, *args) -> None:
        """Run one stage of the write on this rank; stop on every rank if it failed on any."""
        error = None
        try:
            if fn is not None:
                fn(*args)
        except (OSError, SafetensorError) as e:
            error = e
        if not all_ok(error is None):
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            why = _reason(error) if error is not None else "another rank could not write its part"
            raise CheckpointError(f"cannot write checkpoint {final}: {why}; the checkpoints before "
                                  f"it and {root / 'latest'} are intact")

    stage(_fresh_folder if rank == 0 else None, root, tmp)
    stage(_write_rank_state, tmp, rank, rank_state)
    stage(_publish if rank == 0 else None, tmp, final, model, meta, step, world, keep)
    return final


def _fresh_folder(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob(".tmp-step_*"):  # left by a killed save; this process holds the run lock
        shutil.rmtree(old, ignore_errors=True)
    tmp.mkdir()


def _write_rank_state(tmp: Path, rank: int, rank_state: dict) -> None:
    tensors: dict = {}
    structure = flatten(rank_state, "s", tensors)
    save_file(tensors, str(tmp / f"rank{rank}.safetensors"))
    _fsync(tmp / f"rank{rank}.safetensors")  # each rank flushes its own files (its own node's cache)
    write_synced(tmp / f"rank{rank}.json", json.dumps(structure).encode("utf-8"))


def _publish(tmp: Path, final: Path, model: torch.nn.Module, meta: dict, step: int, world: int,
             keep: int) -> None:
    """Rank 0: weights and meta.json into the temporary folder, rename it into place, then `latest`."""
    save_model(model, str(tmp / "model.safetensors"))
    _fsync(tmp / "model.safetensors")
    files = ["model.safetensors"] + [f"rank{r}.{ext}" for r in range(world)
                                     for ext in ("safetensors", "json")]
    meta = dict(meta, step=step, world_size=world, sha256={f: _sha256(tmp / f) for f in files})
    write_synced(tmp / "meta.json", json.dumps(meta, indent=1).encode("utf-8"))
    fsync_dir(tmp)
    if final.exists():
        _remove(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    set_latest(final)
    for old in step_folders(final.parent)[max(keep, 1):]:
        try:
            _remove(old)
        except OSError:  # the new checkpoint is safe; an old one left behind costs only space
            pass


def _remove(ckpt: Path) -> None:
    """Delete a checkpoint folder without ever showing a half-deleted one: rename it to a `.tmp-*`
    name first (atomic), which no loader reads and the next save clears if this one is killed."""
    doomed = ckpt.with_name(f".tmp-{ckpt.name}.removed")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(ckpt, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} ({e.filename})" if e.filename else e.strerror
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def step_folders(root: str | Path) -> list[Path]:
    """The checkpoint folders `step_NNNNNNN` under `root`, newest first (never a `.tmp-*` one)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := re.fullmatch(r"step_(\d+)", p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def newest_intact_checkpoint(run_dir: str | Path, files: list[str] | None = None
                             ) -> tuple[Path, list[tuple[Path, str]]]:
    """The newest checkpoint of a run whose `files` (default: every file it lists) match their
    hashes, and the newer ones that did not (folder, why). `latest` is not consulted: a crash
    between the rename of a folder and the update of `latest` leaves it one behind, and the newest
    complete folder is what counts. Every reader of a run takes its checkpoint from here: resume
    (every file), and through `checkpoint_to_read` eval, generation and export (the weights)."""
    root = Path(run_dir) / "checkpoints"
    skipped = []
    for ckpt in step_folders(root):
        try:
            verify_checkpoint(ckpt, files)
            return ckpt, skipped
        except CheckpointError as e:
            skipped.append((ckpt, str(e)))
    if not skipped:
        raise CheckpointError(f"no checkpoint in {root} to resume from; start over with --restart, "
                              f"or set another train.run_dir")
    raise CheckpointError(f"no intact checkpoint in {root}: " + "; ".join(why for _, why in skipped))


def checkpoint_to_read(path: str | Path, files: tuple[str, ...] = ("model.safetensors",)) -> Path:
    """The checkpoint a reader (eval, generation, export) takes from `path`, its `files` verified.

    A step folder given as itself is that checkpoint or an error (CheckpointError, one line). A
    run dir (or its checkpoints dir) gives its newest checkpoint whose files verify
    (`newest_intact_checkpoint`, as a resume does); each newer one skipped is named on stderr
    with the reason. Unlike a resume, a reader leaves a broken
    checkpoint where it is (it holds no lock on the run)."""
    path = Path(path)
    if (path / "meta.json").is_file():
        verify_checkpoint(path, list(files))
        return path
    run_dir = path.parent if path.name == "checkpoints" and step_folders(path) else path
    if not step_folders(run_dir / "checkpoints"):
        ckpt = find_checkpoint(path)        # its message: not found, no checkpoint, `latest` broken
        verify_checkpoint(ckpt, list(files))
        return ckpt
    ckpt, skipped = newest_intact_checkpoint(run_dir, list(files))
    for bad, why in skipped:
        print(f"skipped checkpoint {bad.name}: {why}; reading {ckpt.name}", file=sys.stderr)
    return ckpt


def set_latest(ckpt: Path) -> None:
    """Point the run's `latest` at `ckpt` (atomically)."""
    atomic_write_text(ckpt.parent / "latest", ckpt.name + "\n")


def set_aside(ckpt: Path) -> Path:
    """Rename a broken checkpoint folder out of the way (kept for inspection, never deleted)."""
    aside, n = ckpt.with_name(f"{ckpt.name}.broken"), 1
    while aside.exists():
        aside, n = ckpt.with_name(f"{ckpt.name}.broken-{n}"), n + 1
    os.rename(ckpt, aside)
    return aside


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
    if not isinstance(meta, dict) or "step" not in meta or not isinstance(meta.get("sha256"), dict):
        raise CheckpointError(f"{ckpt / 'meta.json'}: not an elephant checkpoint")
    return meta


def verify_checkpoint(ckpt: Path, files: list[str] | None = None, hashes: bool = True) -> dict:
    """meta.json of `ckpt` once `files` (default: every file it lists) are there and match their
    SHA-256; CheckpointError naming the first that does not."""
    meta = read_meta(ckpt)
    for f in files if files is not None else list(meta["sha256"]):
        if f not in meta["sha256"] or not (ckpt / f).is_file():
            raise CheckpointError(f"{ckpt / f}: missing (written by {meta.get('world_size')} ranks)")
        if hashes and _sha256(ckpt / f) != meta["sha256"][f]:
            raise CheckpointError(f"{ckpt / f}: corrupt (SHA-256 does not match meta.json)")
    return meta


def load_weights(ckpt: str | Path, model: torch.nn.Module, verify: bool = True) -> dict:
    """Load a checkpoint's weights into `model` (strictly: every tensor, nothing else); its meta."""
    ckpt = find_checkpoint(ckpt)
    meta = verify_checkpoint(ckpt, ["model.safetensors"], hashes=verify)
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
    return meta


def check_model_config(meta: dict, model_config: dict, what: str, hint: str,
                       free: frozenset[str] = frozenset()) -> None:
    """Raise unless the checkpoint whose `meta` is given was written by a model of `model_config`
    (a ModelConfig's dict), keys in `free` aside. A setting the checkpoint does not name is taken
    at its default: a key added later keeps the behaviour the checkpoint was trained with by
    default. The message names `what` (the checkpoint or the option that points at it) and the
    differing keys."""
    from .config import ModelConfig

    saved = ModelConfig().to_dict() | meta.get("config", {}).get("model", {})
    wrong = sorted(k for k in saved.keys() | model_config.keys()
                   if k not in free and saved.get(k) != model_config.get(k))
    if wrong:
        shown = ", ".join(f"model.{k}={saved.get(k)!r} there, {model_config.get(k)!r} here"
                          for k in wrong[:3])
        raise CheckpointError(f"{what}: its model config differs from this run's ({shown}); "
                              f"{hint}")


def init_from(path: str | Path, model: torch.nn.Module, model_config: dict) -> Path:
    """Load the weights of the checkpoint at `path` (itself or a run dir) into `model`, a model
    built from `model_config` (train.init_from: a new stage from another run's weights); the
    checkpoint's model settings must be the same, those that only shape training aside
    (config.stage_free_keys: a stage may, say, drop kept tokens less often or backpropagate
    through more chunks). Returns the checkpoint's folder."""
    from .config import stage_free_keys

    ckpt = find_checkpoint(path)
    check_model_config(read_meta(ckpt), model_config, f"train.init_from={path}",
                       "start from it with the same model.* settings", stage_free_keys(model_config))
    load_weights(ckpt, model)
    return ckpt


def load_checkpoint(ckpt: str | Path, model: torch.nn.Module | None = None, rank: int = 0,
                    verify: bool = True) -> tuple[dict, dict]:
    """Load weights into `model` (strictly) and return (meta, this rank's state) of a checkpoint."""
    ckpt = find_checkpoint(ckpt)
    meta = verify_checkpoint(ckpt, ["model.safetensors", f"rank{rank}.safetensors",
                                    f"rank{rank}.json"], hashes=verify)
    if model is not None:
        load_weights(ckpt, model, verify=False)
    try:
        tensors = load_file(str(ckpt / f"rank{rank}.safetensors"))
        structure = json.loads((ckpt / f"rank{rank}.json").read_text())
    except (SafetensorError, OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt}: rank {rank} state unreadable ({e})") from None
    return meta, unflatten(structure, tensors)
