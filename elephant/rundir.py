"""Who owns a run dir: one training process at a time, and no earlier run is restarted silently.

`claim_run_dir` runs on rank 0 before the trainer writes anything:
- The lock `RUN_DIR/.lock` (JSON: pid, host, the process's start time, when, the command) is created
  with O_CREAT | O_EXCL, so of two processes only one gets it; the other is refused with a message
  naming the first. A lock whose process is gone (same host; the pid is not running, is a zombie,
  or now belongs to a process started later) is taken over with a message. A lock written on
  another host is always respected: this host cannot see whether that process lives, so the
  message says to delete the file if it does not. A lock that cannot be read (a process killed
  between creating and filling it) is respected the same way.
- A run dir that holds an earlier run (checkpoints, or a non-empty log.jsonl) is refused unless
  the run resumes it; `restart=True` renames the earlier run to `RUN_DIR.old-YYYYmmdd-HHMMSS`
  (never deletes it) and starts in a fresh folder.
The lock is released when the trainer ends, also on errors. A process killed with SIGKILL leaves
its lock behind; the next run on the dir finds the pid gone and takes it over.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import time
import weakref
from pathlib import Path

from .checkpoint import step_folders
from .fsutil import write_synced

LOCK = ".lock"


class RunDirError(ValueError):
    """The run dir is in use or holds an earlier run; the message is for the user as it is."""


# ------------------------------------------------------------------ processes
def _proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (state first, start time at index 19); None off Linux."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _start_time(pid: int) -> str | None:
    fields = _proc_stat(pid)
    return fields[19] if fields else None


def process_alive(pid: int, start: str | None = None) -> bool:
    """Whether process `pid` of this host runs, and is the one that started at `start` (a pid
    can be reused by a later process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    except (OverflowError, ValueError):
        return False
    fields = _proc_stat(pid)
    if fields is None:
        return True  # no /proc: existence is all we can tell
    if fields[0] in ("Z", "X"):  # killed, not yet reaped by its parent
        return False
    return start is None or fields[19] == start


# ------------------------------------------------------------------ the lock
class RunLock:
    """A held `.lock`; `release()` removes it (only if it is still ours), as does garbage collection
    or the interpreter's exit."""

    def __init__(self, path: Path, token: str):
        self.path = path
        self._finalizer = weakref.finalize(self, _remove_if_ours, path, token)

    def release(self) -> None:
        self._finalizer()

    def forget(self) -> None:
        """Stop tracking the file (it moved away with its folder)."""
        self._finalizer.detach()


def _read(path: Path) -> dict | None:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None


def _remove_if_ours(path: Path, token: str) -> None:
    holder = _read(path)
    if holder is not None and holder.get("token") == token:
        path.unlink(missing_ok=True)


def acquire_lock(run_dir: Path, command: str = "") -> RunLock:
    """Take `run_dir/.lock`, or raise RunDirError naming the process that holds it."""
    path = Path(run_dir) / LOCK
    me = {"pid": os.getpid(), "host": socket.gethostname(), "pid_start": _start_time(os.getpid()),
          "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command,
          "token": secrets.token_hex(8)}
    for _ in range(5):  # a stale lock taken over by another process at the same moment: look again
        try:
            write_synced(path, json.dumps(me).encode("utf-8"))  # O_CREAT | O_EXCL: one winner
            return RunLock(path, me["token"])
        except FileExistsError:
            holder = _read(path)
            if holder is None:
                if path.exists():
                    raise RunDirError(f"{run_dir} is locked by {path}, which cannot be read; if no "
                                      f"run uses this folder, delete that file") from None
                continue  # released between our two looks
            if holder.get("host") != me["host"]:
                raise RunDirError(
                    f"{run_dir} is in use by pid {holder['pid']} on host {holder.get('host')} since "
                    f"{holder.get('since')} (lock {path}); this host cannot tell whether it still "
                    f"runs: if it does not, delete that file") from None
            if process_alive(holder["pid"], holder.get("pid_start")):
                raise RunDirError(
                    f"{run_dir} is in use by pid {holder['pid']} on this host since "
                    f"{holder.get('since')} ({holder.get('command') or 'train.py'}); wait for it or "
                    f"stop it, or set another train.run_dir") from None
            _take_over(path, holder)
        except OSError:
            path.unlink(missing_ok=True)  # created but not filled (a full disk): leave no husk
            raise
    raise RunDirError(f"{path}: other processes keep taking this lock; try again")


def _take_over(path: Path, holder: dict) -> None:
    """Remove a stale lock, unless another process replaced it since we read it."""
    aside = path.with_name(f"{LOCK}.stale-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another process took it over first
    if _read(aside) != holder:  # we moved a fresh lock: put it back (link fails if one is there)
        try:
            os.link(aside, path)
        except OSError:
            pass
    else:
        print(f"taking over the lock {path} of pid {holder['pid']} (since {holder.get('since')}): "
              f"that process is gone", file=sys.stderr)
    aside.unlink(missing_ok=True)


# ------------------------------------------------------------------ claiming a run dir
def earlier_run(run_dir: Path) -> str | None:
    """What in `run_dir` belongs to an earlier run, in words; None for a fresh folder."""
    steps = step_folders(run_dir / "checkpoints")
    if steps:
        return f"checkpoints up to {steps[0].name}"
    log = run_dir / "log.jsonl"
    if log.is_file() and log.stat().st_size:
        return "a log.jsonl, no checkpoint yet"
    return None


def claim_run_dir(run_dir: str | Path, resume: bool = False, restart: bool = False,
                  command: str = "") -> RunLock:
    """Lock `run_dir` for this process and make sure starting or resuming there loses nothing."""
    run_dir = Path(run_dir)
    if resume and not run_dir.is_dir():
        raise RunDirError(f"checkpoint not found: {run_dir} does not exist (nothing to resume)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = acquire_lock(run_dir, command)
    except OSError as e:
        raise RunDirError(f"{run_dir}: cannot create the run dir or its lock "
                          f"({e.strerror or e})") from None
    try:
        earlier = None if resume else earlier_run(run_dir)
        if earlier and not restart:
            how = "" if "no checkpoint" in earlier else "continue it with --resume, "
            raise RunDirError(f"{run_dir} holds an earlier run ({earlier}): {how}start over with "
                              f"--restart (moves it to {run_dir.name}.old-<time>), or set another "
                              f"train.run_dir")
        if earlier:
            aside = _free_name(run_dir)
            os.rename(run_dir, aside)  # the lock moves with it: the earlier run stays locked
            lock.forget()
            (aside / LOCK).unlink(missing_ok=True)
            print(f"moved the earlier run in {run_dir} to {aside}", file=sys.stderr)
            run_dir.mkdir()
            lock = acquire_lock(run_dir, command)
    except OSError as e:
        lock.release()
        raise RunDirError(f"{run_dir}: cannot set up the run dir ({e.strerror or e})") from None
    except BaseException:
        lock.release()
        raise
    return lock


def _free_name(run_dir: Path) -> Path:
    base = f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    aside, n = run_dir.with_name(base), 1
    while aside.exists():
        aside, n = run_dir.with_name(f"{base}-{n}"), n + 1
    return aside
