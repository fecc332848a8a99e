"""Writing files so that a reader sees the old version or the new one, never half of either.

`atomic_write_text` / `atomic_write_json` write a hidden temporary file beside the target, flush it
to disk, and rename it over the target (`os.replace` is atomic on POSIX), then flush the folder so
the rename itself survives a power cut. A process killed at any point leaves the target as it was,
plus at most a `.NAME.tmp-PID-XXXX` file that nothing reads. A checkpoint's `latest`, the run's
resolved_config.json and env.json and `eval.py --json` are written this way; a checkpoint's own
files and the run lock use `write_synced` (a new file, flushed), the step before the rename.
"""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path


def temp_name(path: Path) -> Path:
    """A hidden, unique sibling of `path` to write into before the rename."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to a new file `path` and flush it to disk."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename into it) to disk; a no-op where the OS cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a folder; the rename is still atomic
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    tmp = temp_name(path)
    try:
        write_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj, **dumps_kwargs) -> None:
    atomic_write_text(path, json.dumps(obj, **dumps_kwargs) + "\n")
