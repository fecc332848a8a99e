"""Runs that survive people and clusters: the run-dir lock, no silent restart, resuming from the
newest intact checkpoint, SIGTERM / SIGINT (also under torchrun), a full disk during a save,
invalid UTF-8 counted, and SIGKILL at random moments of training and of `eval.py --json`.

The fault-injection tests fork their victims from a "zygote": one Python process that imports
torch and the project once and forks a child per run, so a few dozen kills cost seconds, not a
fresh interpreter each. A child dies by a real SIGKILL, from outside at a random time or from
inside at a chosen write of a checkpoint (every file write, fsync, rename and deletion counts as
one) or halfway through writing a file.
"""
import errno
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train as train_cli
from data_packing import prepare
from elephant import checkpoint
from elephant.checkpoint import (CheckpointError, load_checkpoint, newest_intact_checkpoint,
                                 step_folders, verify_checkpoint)
from elephant.config import load_config
from elephant.rundir import LOCK, RunDirError, acquire_lock
from elephant.trainer import Trainer, read_log
from test_trainer import ROOT, corpus_dir, losses, overrides, run_cli  # noqa: F401 (a fixture)

TRAIN = ["--config", "configs/tiny.toml", "--no-progress"]


def one_line_error(err: str) -> str:
    """The one line of the error (after whatever progress was printed before it)."""
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in err, err
    assert sum(line.startswith("error") for line in lines) == 1, err
    return lines[-1]


def tree(folder: Path) -> dict:
    """Every file under `folder` with its bytes: a snapshot to compare."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def wait_until_step(proc: subprocess.Popen, run: Path, step: int) -> None:
    """Until the run has logged `step` (the process must still be running)."""
    deadline = time.time() + 300
    while not (run / "log.jsonl").exists() or max(losses(run), default=0) < step:
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
        time.sleep(0.01)


def assert_checkpoints_intact(run: Path) -> None:
    """Every checkpoint a loader can find is complete, and `latest` names one of them."""
    root = run / "checkpoints"
    folders = step_folders(root)
    for ckpt in folders:
        verify_checkpoint(ckpt)
    if (root / "latest").exists():
        assert root / (root / "latest").read_text().strip() in folders


# ---------------------------------------------------------------------------- the zygote
ZYGOTE = r"""
import json, os, signal, sys, time, traceback
import torch
torch.set_num_threads(1)
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot
import eval as eval_cli
import train
import elephant.checkpoint as ck, elephant.fsutil as fs, elephant.hub, elephant.trainer
import data_packing.batcher, data_packing.prepare

def arm(k, sig):
    # send `sig` to this process just before its k-th write step (a file written, fsync, rename,
    # deletion)
    count = [0]
    def wrap(fn):
        def inner(*args, **kwargs):
            count[0] += 1
            if count[0] == k:
                os.kill(os.getpid(), sig)
            return fn(*args, **kwargs)
        return inner
    for mod, name in ((ck, "save_file"), (ck, "save_model"), (ck, "write_synced"), (ck, "_fsync"),
                      (ck, "fsync_dir"), (ck, "atomic_write_text"), (fs, "write_synced"),
                      (os, "replace"), (os, "rename"), (os, "unlink"), (os, "rmdir")):
        setattr(mod, name, wrap(getattr(mod, name)))

def cut(part, k):
    # the k-th write to a file whose path holds `part` writes half its data, then SIGKILL
    import builtins, io
    real, count = builtins.open, [0]

    class Cut:
        def __init__(self, f):
            self._f = f
        def write(self, data):
            count[0] += 1
            if count[0] == k:
                self._f.write(data[: len(data) // 2])
                self._f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return self._f.write(data)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return self._f.__exit__(*exc)
        def __getattr__(self, name):
            return getattr(self._f, name)

    def opener(file, mode="r", *args, **kwargs):
        f = real(file, mode, *args, **kwargs)
        return Cut(f) if part in str(file) and set(mode) & set("wxa") else f
    builtins.open = io.open = opener

for line in sys.stdin:
    cmd = json.loads(line)
    sys.stdout.flush()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            fd = os.open(cmd["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            if cmd.get("at_write"):
                arm(*cmd["at_write"])
            if cmd.get("cut"):
                cut(*cmd["cut"])
            code = (train.main if cmd["cli"] == "train" else eval_cli.main)(cmd["argv"])
        except BaseException:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    signals = list(cmd.get("signals", []))
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if signals and time.monotonic() - start >= signals[0][0]:
            os.kill(pid, signals.pop(0)[1])
        time.sleep(0.002)
    print(json.dumps({"code": os.waitstatus_to_exitcode(status),
                      "seconds": time.monotonic() - start}), flush=True)
"""


class Zygote:
    def __init__(self, folder: Path):
        self.folder, self.n = folder, 0
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def run(self, cli: str, argv: list[str], signals=(), at_write=None, cut=None, timeout=120):
        """Run train.py or eval.py (`cli`) in a forked child and wait for it to end. `signals`:
        (seconds after the start, signal) sent from outside; `at_write`: (k, signal) sent by the
        child to itself just before its k-th write step; `cut`: (part of a path, k) the k-th write
        into such a file writes half its data, then the child SIGKILLs itself.
        Returns (exit code, negative for a signal; seconds; what the child printed)."""
        self.n += 1
        out = self.folder / f"child{self.n}.txt"
        cmd = {"cli": cli, "argv": [str(a) for a in argv], "out": str(out),
               "signals": [list(s) for s in signals], "at_write": at_write, "cut": cut}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"{cli} {argv} did not end in {timeout}s"
        reply = json.loads(self.proc.stdout.readline())
        return reply["code"], reply["seconds"], out.read_text()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


# ---------------------------------------------------------------------------- the lock
def test_second_process_on_a_run_dir_is_refused_naming_the_first(tmp_path, corpus_dir, capsys):
    run = tmp_path / "run"
    # quiet (a full pipe would block it), and training once log.jsonl has its first record
    over = overrides(run, corpus_dir, **{"train.max_steps": 100000, "train.log_every": 100000})
    first = run_cli(["train.py", *TRAIN, *over])
    try:
        deadline = time.time() + 120
        while not (run / "log.jsonl").is_file() or not (run / "log.jsonl").stat().st_size:
            assert first.poll() is None and time.time() < deadline, first.stdout.read()
            time.sleep(0.05)
        for flags in ([], ["--resume"], ["--restart"]):
            assert train_cli.main([*TRAIN, *over, *flags]) == 2
            err = one_line_error(capsys.readouterr().err)
            assert f"{run} is in use by pid {first.pid} on this host" in err, err
            assert first.poll() is None  # the first run goes on
        assert not list(tmp_path.glob("run.old-*"))  # --restart moved nothing
    finally:
        first.kill()
        first.wait()
    # SIGKILL left the lock behind; the next claim finds its process gone and takes it over
    assert json.loads((run / LOCK).read_text())["pid"] == first.pid
    lock = acquire_lock(run)
    assert f"taking over the lock {run / LOCK} of pid {first.pid}" in capsys.readouterr().err
    assert json.loads((run / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run / LOCK).exists()


def test_lock_of_a_dead_or_reused_pid_is_taken_over_others_are_respected(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    host = socket.gethostname()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cases = [  # (lock content, refused with)
            ({"pid": gone.pid, "host": host, "since": "then"}, None),
            ({"pid": os.getpid(), "host": host, "pid_start": "1", "since": "boot"}, None),  # reused
            ({"pid": sleeper.pid, "host": host, "since": "now"},
             f"is in use by pid {sleeper.pid} on this host"),
            ({"pid": gone.pid, "host": "elsewhere", "since": "now"},
             f"in use by pid {gone.pid} on host elsewhere since now (lock {run / LOCK}); this host "
             f"cannot tell whether it still runs: if it does not, delete that file"),
            ("", "which cannot be read; if no run uses this folder, delete that file"),
        ]
        for content, refused in cases:
            (run / LOCK).write_text(json.dumps(content) if content else "")
            if refused:
                with pytest.raises(RunDirError) as e:
                    acquire_lock(run)
                assert refused in str(e.value)
            else:
                lock = acquire_lock(run)
                assert f"of pid {content['pid']}" in capsys.readouterr().err
                lock.release()
                assert not (run / LOCK).exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_lock_is_released_when_the_run_fails(tmp_path, corpus_dir, capsys):
    run = tmp_path / "run"
    assert train_cli.main([*TRAIN, *overrides(run, corpus_dir), "model.vocab_size=100"]) == 2
    assert "smaller than the tokenizer's vocabulary" in one_line_error(capsys.readouterr().err)
    assert not (run / LOCK).exists()


# ---------------------------------------------------------------------------- no silent restart
def test_run_dir_with_a_run_needs_resume_or_restart_and_restart_keeps_it(tmp_path, corpus_dir,
                                                                        capsys):
    run = tmp_path / "run"
    over = overrides(run, corpus_dir, **{"train.max_steps": 2})
    assert train_cli.main([*TRAIN, *over]) == 0
    before = tree(run)
    assert train_cli.main([*TRAIN, *over]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert err == (f"error: {run} holds an earlier run (checkpoints up to step_0000002): continue "
                   f"it with --resume, start over with --restart (moves it to run.old-<time>), or "
                   f"set another train.run_dir")
    assert tree(run) == before  # nothing written, nothing pruned
    assert train_cli.main([*TRAIN, *over, "--restart"]) == 0
    moved = list(tmp_path.glob("run.old-*"))
    assert len(moved) == 1 and tree(moved[0]) == before  # moved aside whole, never deleted
    assert f"moved the earlier run in {run} to {moved[0]}" in capsys.readouterr().err
    assert sorted(losses(run)) == [1, 2]  # a fresh log
    # a run killed before its first checkpoint has only a log: --resume cannot help, --restart can
    logged = tmp_path / "logged"
    logged.mkdir()
    (logged / "log.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0}\n')
    assert train_cli.main([*TRAIN, *overrides(logged, corpus_dir)]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert "holds an earlier run (a log.jsonl, no checkpoint yet): start over with --restart" in err


# ---------------------------------------------------------------------------- broken checkpoints
def test_resume_skips_broken_checkpoints_and_continues_identically(tmp_path, corpus_dir, capsys):
    run = tmp_path / "run"
    over = overrides(run, corpus_dir, **{"train.max_steps": 6, "train.ckpt_every": 2,
                                         "train.keep_ckpts": 5})
    assert train_cli.main([*TRAIN, *over]) == 0
    ref = losses(run)
    root = run / "checkpoints"
    weights = root / "step_0000006" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    (root / "step_0000004" / "rank0.json").unlink()
    (root / "latest").write_text("step_0000009\n")  # names a folder that is not there
    log_lines = (run / "log.jsonl").read_text().count("\n")
    capsys.readouterr()
    trainer = Trainer(load_config(ROOT / "configs/tiny.toml", over), resume=True, progress=False)
    assert (root / "latest").read_text() == "step_0000002\n"  # no longer names a broken one
    trainer.fit()
    err = capsys.readouterr().err
    assert (f"skipped checkpoint step_0000006: {weights}: corrupt (SHA-256 does not match "
            f"meta.json); moved it to step_0000006.broken") in err
    assert (f"skipped checkpoint step_0000004: {root / 'step_0000004' / 'rank0.json'}: missing"
            in err)
    assert f"resumed from {root / 'step_0000002'} at step 2" in err
    assert (root / "step_0000006.broken" / "model.safetensors").is_file()  # kept, not deleted
    records = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()[log_lines:]]
    again = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    assert sorted(again) == [3, 4, 5, 6] and all(again[s] == ref[s] for s in again)  # bitwise
    assert [r["skipped"] for r in records if r["kind"] == "resumed"][0][0]["checkpoint"] == \
        str(root / "step_0000006")
    assert_checkpoints_intact(run)
    # none intact: stop, naming each
    for ckpt in step_folders(root):
        (ckpt / "meta.json").write_text("{")
    assert train_cli.main([*TRAIN, *over, "--resume"]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert f"no intact checkpoint in {root}: " in err and "meta.json: unreadable" in err


# ---------------------------------------------------------------------------- signals
def test_sigterm_finishes_the_step_checkpoints_and_resumes_identically(zygote, tmp_path,
                                                                       corpus_dir):
    over = {"train.max_steps": 20}
    ref = tmp_path / "ref"
    code, _, out = zygote.run("train", TRAIN + overrides(ref, corpus_dir, **over))
    assert code == 0, out
    run = tmp_path / "run"  # a train.py of its own, signalled as a cluster would
    p = run_cli(["train.py", *TRAIN, *overrides(run, corpus_dir, **over)])
    wait_until_step(p, run, 3)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 143, out
    step = max(losses(run))
    assert step < 20, "the run ended before the signal"
    ckpt = run / "checkpoints" / f"step_{step:07d}"
    assert "received SIGTERM: finishing this step, then writing a checkpoint" in out
    assert out.strip().splitlines()[-1] == (f"stopped by SIGTERM after step {step}: wrote {ckpt}; "
                                            f"continue with --resume")
    assert (run / "checkpoints" / "latest").read_text().strip() == ckpt.name
    assert not (run / LOCK).exists()
    code, _, out = zygote.run("train", TRAIN + overrides(run, corpus_dir, **over) + ["--resume"])
    assert code == 0, out
    assert f"resumed from {ckpt} at step {step}" in out
    assert losses(run) == losses(ref)  # bitwise


def test_sigint_during_a_step_in_process(tmp_path, corpus_dir):
    run = tmp_path / "run"
    cfg = load_config(ROOT / "configs/tiny.toml", overrides(run, corpus_dir))
    trainer = Trainer(cfg, progress=False)
    step = trainer.train_step

    def interrupted_third_step():
        if trainer.step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # arrives in the middle of step 3
        return step()
    trainer.train_step = interrupted_third_step
    handler = signal.getsignal(signal.SIGINT)
    result = trainer.fit()
    assert result["preempted"] == signal.SIGINT and result["step"] == 3
    assert result["checkpoint"] == run / "checkpoints" / "step_0000003"
    assert load_checkpoint(run)[0]["step"] == 3
    assert signal.getsignal(signal.SIGINT) is handler  # restored
    assert not (run / LOCK).exists()
    assert [r["signal"] for r in read_log(run / "log.jsonl") if r["kind"] == "preempted"] == ["SIGINT"]


def test_a_second_signal_stops_at_once_but_a_launchers_echo_does_not():
    code = """if True:
        import os, signal, time
        from elephant.preemption import StopRequest
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the same request forwarded by a launcher
            time.sleep(0.05)
            print("flag", stop.signum, flush=True)
            time.sleep(1.1)
            os.kill(os.getpid(), signal.SIGTERM)  # a second request: stop now
            time.sleep(10)
            print("still running", flush=True)
    """
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == -signal.SIGTERM, p.stderr
    assert p.stdout == f"flag {int(signal.SIGTERM)}\n"
    assert p.stderr.count("received SIGTERM") == 1


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2:].split()[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _rank_pid(launcher: int, rank: int) -> int | None:
    for pid in _children(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


@pytest.mark.skipif(not torch.distributed.is_gloo_available() or not Path("/proc").is_dir(),
                    reason="needs gloo and /proc")
def test_torchrun_ranks_agree_on_the_step_when_one_rank_is_signalled(tmp_path, corpus_dir):
    over = {"train.max_steps": 24}
    ref = tmp_path / "ref"  # one process with grad_accum 2 reads the data of two ranks
    assert train_cli.main([*TRAIN, *overrides(ref, corpus_dir, **over, **{"train.grad_accum": 2})]) == 0
    run = tmp_path / "run"
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                *TRAIN, *overrides(run, corpus_dir, **over)]
    p = run_cli(torchrun)
    wait_until_step(p, run, 3)
    rank1 = _rank_pid(p.pid, 1)
    assert rank1 is not None
    os.kill(rank1, signal.SIGTERM)  # rank 0 is not told: it learns it from rank 1
    out = p.communicate(timeout=300)[0]
    step = max(losses(run))
    assert step < 24, "the run ended before the signal"
    ckpt = run / "checkpoints" / f"step_{step:07d}"
    assert f"stopped by SIGTERM after step {step}: wrote {ckpt}" in out, out
    meta = verify_checkpoint(ckpt)
    assert meta["world_size"] == 2 and meta["step"] == step  # both ranks wrote the same step
    p = run_cli(torchrun + ["--resume"])
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out
    a, b = losses(ref), losses(run)
    assert sorted(a) == sorted(b) == list(range(1, 25))
    for s in a:  # fp32 sums in another order: equal to ~1e-6 relative
        assert abs(a[s] - b[s]) <= 1e-5 * abs(a[s]), (s, a[s], b[s])


# ---------------------------------------------------------------------------- a full disk
@pytest.mark.parametrize("fails", ["save_file", "save_model", "write_synced", "fsync_dir",
                                   "atomic_write_text"])
def test_full_disk_during_a_save_leaves_the_earlier_checkpoints_intact(tmp_path, corpus_dir,
                                                                       monkeypatch, fails):
    run = tmp_path / "run"
    cfg = load_config(ROOT / "configs/tiny.toml", overrides(run, corpus_dir, **{"train.keep_ckpts": 2}))
    trainer = Trainer(cfg, progress=False)
    for _ in range(2):
        trainer.train_step()
        trainer.train_step()
        trainer.save()
    before = tree(run / "checkpoints")
    trainer.train_step()
    original = getattr(checkpoint, fails)

    def full(*args, **kwargs):
        if fails == "write_synced" and not str(args[0]).endswith("meta.json"):
            return original(*args, **kwargs)  # the last file of the folder fails
        path = args[1] if fails in ("save_file", "save_model") else args[0]
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    monkeypatch.setattr(checkpoint, fails, full)
    with pytest.raises(CheckpointError) as e:
        trainer.save()
    msg = str(e.value)
    root = run / "checkpoints"
    assert msg.startswith(f"cannot write checkpoint {root / 'step_0000005'}: No space left on "
                          f"device") and "\n" not in msg
    assert msg.endswith(f"the checkpoints before it and {root / 'latest'} are intact")
    assert not list(root.glob(".tmp-*"))
    after = tree(root)
    if fails == "atomic_write_text":  # the folder was complete and renamed; only `latest` lags
        assert {k: v for k, v in after.items() if not k.startswith("step_0000005/")} == before
        assert newest_intact_checkpoint(run)[0] == root / "step_0000005"
    else:
        assert after == before
    assert_checkpoints_intact(run)
    trainer.close()


def test_full_disk_is_a_one_line_error_of_train_py(tmp_path, corpus_dir, monkeypatch, capsys):
    def full(model, filename, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
    monkeypatch.setattr(checkpoint, "save_model", full)
    run = tmp_path / "run"
    assert train_cli.main([*TRAIN, *overrides(run, corpus_dir, **{"train.max_steps": 2})]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert err.startswith(f"error: cannot write checkpoint {run / 'checkpoints' / 'step_0000002'}: "
                          f"No space left on device")
    assert not (run / LOCK).exists() and not list((run / "checkpoints").iterdir())


# ---------------------------------------------------------------------------- invalid UTF-8
def test_documents_with_invalid_utf8_are_counted_by_prepare_and_in_the_run_log(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.jsonl").write_bytes(b'{"text": "good words here"}\n{"text": "bad \xff byte"}\n'
                                      b'{"text": "more good words"}\n')
    (src / "valid.jsonl").write_text('{"text": "valid words"}\n')
    assert prepare.main(["--source", "text", "--path", str(src), "--tokenizer", "bytes",
                         "--out", str(tmp_path / "prepared"), "--workers", "1"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["invalid_utf8_docs"] == 1
    assert "3 docs" in err and "1 document had bytes that are not UTF-8, replaced by U+FFFD" in err
    run = tmp_path / "run"
    over = overrides(run, src, **{"train.max_steps": 1})
    assert train_cli.main([*TRAIN, *over]) == 0
    assert "note: 1 document of the train split had bytes that are not UTF-8" in capsys.readouterr().err
    data = [r for r in read_log(run / "log.jsonl") if r["kind"] == "data"]
    assert data[0]["train"]["invalid_utf8_docs"] == 1 and data[0]["train"]["documents"] == 3


# ---------------------------------------------------------------------------- fault injection
def test_sigkill_at_random_moments_never_loses_or_corrupts_a_run(zygote, tmp_path, corpus_dir):
    """Kill the trainer a few dozen times, from outside at random times and from inside at a
    random write of a checkpoint; after each kill every checkpoint a loader could see is complete,
    and every loss the next process logs equals the uninterrupted run's, to the last bit. A run
    that reaches its end before the next kill is started over with --restart."""
    rng = random.Random(14)
    steps, kills = 80, 30
    over = {"train.max_steps": steps, "train.keep_ckpts": 2}
    ref = tmp_path / "ref"
    code, _, out = zygote.run("train", TRAIN + overrides(ref, corpus_dir, **over))
    assert code == 0, out
    want = losses(ref)
    run = tmp_path / "run"
    argv = TRAIN + overrides(run, corpus_dir, **over, **{"train.ckpt_every": 1})
    at_a_write, code = 0, None
    for attempt in range(kills + 1):
        flags = (["--restart"] if code == 0 else ["--resume"] if step_folders(run / "checkpoints")
                 else ["--restart"] if run.exists() else [])
        log = run / "log.jsonl"
        offset = log.stat().st_size if log.exists() and flags == ["--resume"] else 0
        if attempt == kills:  # the last one runs to the end
            code, _, out = zygote.run("train", argv + flags)
        elif attempt % 5 < 2:
            code, _, out = zygote.run("train", argv + flags, signals=[[rng.uniform(0, 1.0), 9]])
        elif attempt % 5 < 4:
            code, _, out = zygote.run("train", argv + flags, at_write=[rng.randint(1, 30), 9])
            at_a_write += code == -9
        else:  # half a line of the log, of a checkpoint's meta.json, of `latest`
            part = ["log.jsonl", "meta.json", "latest"][attempt // 5 % 3]
            code, _, out = zygote.run("train", argv + flags, cut=[part, rng.randint(1, 4)])
        assert code in (-9, 0) and "Traceback" not in out, out
        assert "skipped checkpoint" not in out, out  # nothing it found was partial
        assert_checkpoints_intact(run)
        text = log.read_bytes().decode("utf-8", "replace") if log.exists() else ""
        assert all(line.count('{"time"') <= 1 for line in text.splitlines())  # none glued to a cut one
        for line in text[offset:].splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line the kill cut short
            if record["kind"] == "train":
                assert record["loss"] == want[record["step"]], (attempt, record["step"])
    assert code == 0, out
    assert at_a_write >= kills // 4
    assert losses(run) == want
    (meta_a, a), (meta_b, b) = load_checkpoint(ref), load_checkpoint(run)
    assert meta_a["step"] == meta_b["step"] == steps
    assert meta_a["sha256"]["model.safetensors"] == meta_b["sha256"]["model.safetensors"]
    assert json.dumps(a, default=lambda t: t.tolist()) == json.dumps(b, default=lambda t: t.tolist())


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, corpus_dir) -> Path:
    run = tmp_path_factory.mktemp("evalrun") / "run"
    assert train_cli.main([*TRAIN, *overrides(run, corpus_dir, **{"train.max_steps": 2})]) == 0
    return run


def test_sigkill_during_eval_never_leaves_a_half_written_json(zygote, trained_run, tmp_path):
    rng = random.Random(3)
    argv = ["--checkpoint", trained_run, "--split", "valid", "--lanes", "2", "--no-progress",
            "--json"]
    code, seconds, out = zygote.run("eval", argv + [tmp_path / "ref.json"])
    assert code == 0, out
    want = (tmp_path / "ref.json").read_text()
    target = tmp_path / "results.json"
    target.write_text('{"from": "an earlier evaluation"}\n')
    seen, killed = {target.read_text()}, 0
    for attempt in range(12):
        before = target.read_text()
        if attempt % 3 == 0:
            code, _, out = zygote.run("eval", argv + [target], signals=[[rng.uniform(0, seconds), 9]])
        elif attempt % 3 == 1:
            code, _, out = zygote.run("eval", argv + [target], at_write=[rng.randint(1, 2), 9])
        else:  # killed halfway through writing the JSON
            code, _, out = zygote.run("eval", argv + [target], cut=["results.json", 1])
        killed += code == -9
        assert code in (-9, 0), out
        now = target.read_text()  # never missing, never half of either
        assert now in (before, want), now[:200]
        seen.add(now)
        json.loads(now)
        target.write_text('{"from": "an earlier evaluation"}\n')
    assert killed >= 8
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == \
        ["ref.json", "results.json"]
    # SIGTERM just as the JSON is about to be written: one line, the file as it was
    code, _, out = zygote.run("eval", argv + [target], at_write=[1, signal.SIGTERM])
    assert code == 143
    assert out.strip().splitlines()[-1] == f"interrupted by SIGTERM; {target} was left as it was"
    assert target.read_text() == '{"from": "an earlier evaluation"}\n'
