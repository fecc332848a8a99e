"""train.py and the Trainer: config errors, exact resume after SIGKILL, data parallel == one
process, non-finite losses, refused checkpoints."""
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import train as train_cli
from elephant.checkpoint import CheckpointError, load_checkpoint
from elephant.config import ConfigError, load_config
from elephant.trainer import Trainer, TrainingStopped, read_log

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """A small text corpus with structure to learn: documents of 200-2000 bytes."""
    d = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["elephant", "memory", "state", "chunk", "lane", "document", "token", "carry"]
    for split, n in (("train", 40), ("valid", 6)):
        with open(d / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                k = rng.randint(30, 300)
                text = " ".join(words[(i * 3 + rng.randint(0, 1)) % len(words)] for i in range(k))
                f.write(json.dumps({"text": text}) + "\n")
    return d


def overrides(run_dir: Path, corpus_dir: Path, **extra) -> list[str]:
    base = {
        "data.source": "text", "data.path": str(corpus_dir), "data.tokenizer": "bytes",
        "data.cache_dir": str(run_dir.parent / "cache"), "train.run_dir": str(run_dir),
        "train.lanes": 3, "train.chunk_len": 32, "train.max_steps": 8, "train.log_every": 1,
        "train.eval_every": 0, "train.eval_docs": 3, "train.ckpt_every": 0, "train.compile": "off",
        "train.tensorboard": False, "optim.warmup_steps": 2, "optim.momentum_warmup_steps": 4,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(run_dir / "log.jsonl") if r["kind"] == "train"}


def run_cli(args: list[str], env_extra: dict | None = None, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


# ---------------------------------------------------------------------------- config errors
@pytest.mark.parametrize("override, message", [
    ("model.d_modle=64", "unknown key model.d_modle (did you mean model.d_model?)"),
    ("model.d_model=big", "model.d_model: expected int, got str 'big'"),
    ("optim.schedule=cosin", "optim.schedule: expected one of constant, linear, cosine, got 'cosin'"),
    ("trian.lanes=2", "unknown section 'trian' (did you mean train?)"),
])
def test_bad_override_is_one_line_error(override, message, capsys):
    assert train_cli.main(["--config", str(ROOT / "configs/tiny.toml"), override]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {message}" or err.endswith(message), err
    assert "Traceback" not in err and "\n" not in err


def test_recipes_load_and_validate():
    for recipe in sorted((ROOT / "configs").glob("*.toml")):
        cfg = load_config(recipe)
        assert cfg.model.d_model > 0, recipe


def test_a_recipe_starts_from_its_base_and_replaces_what_it_sets(tmp_path):
    from elephant.config import ConfigError
    stage2 = load_config(ROOT / "configs/recall-stage2.toml")
    first = load_config(ROOT / "configs/recall.toml")
    assert stage2.model == first.model                                      # the base's, untouched
    # and its data but the length curriculum, which a stage from trained weights turns off
    assert first.data.length_curriculum_steps > 0 and stage2.data.length_curriculum_steps == 0
    assert replace(stage2.data, length_curriculum_steps=first.data.length_curriculum_steps) == first.data
    assert (stage2.optim.muon_lr, stage2.train.max_steps) == (first.optim.muon_lr / 2, 180)
    assert stage2.train.lanes == first.train.lanes and stage2.train.init_from == "runs/recall"
    # a base in another folder, chained, then overridden on the command line
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.toml").write_text(f'base = "{ROOT / "configs/tiny.toml"}"\n[train]\nlanes = 3\n')
    (tmp_path / "c.toml").write_text('base = "sub/b.toml"\n[train]\nmax_steps = 7\n')
    c = load_config(tmp_path / "c.toml", ["train.lanes=5"])
    assert (c.train.lanes, c.train.max_steps) == (5, 7)
    assert load_config(tmp_path / "sub" / "b.toml").train.lanes == 3
    (tmp_path / "loop.toml").write_text('base = "loop2.toml"\n')
    (tmp_path / "loop2.toml").write_text('base = "loop.toml"\n')
    with pytest.raises(ConfigError, match="leads back to itself"):
        load_config(tmp_path / "loop.toml")
    (tmp_path / "orphan.toml").write_text('base = "gone.toml"\n')
    with pytest.raises(ConfigError, match=r"config file not found: .*gone.toml \(the base of .*orphan.toml\)"):
        load_config(tmp_path / "orphan.toml")


def test_missing_config_file_is_one_line_error(capsys):
    assert train_cli.main(["--config", "configs/nope.toml"]) == 2
    assert capsys.readouterr().err.strip() == "error: config file not found: configs/nope.toml"


# ---------------------------------------------------------------------------- training
def test_training_learns_and_writes_its_run_dir(tmp_path, corpus_dir):
    run = tmp_path / "run"
    cfg = load_config(ROOT / "configs/tiny.toml",
                      overrides(run, corpus_dir, **{"train.max_steps": 25, "train.eval_every": 25}))
    result = Trainer(cfg, progress=False).fit()
    ls = losses(run)
    assert sorted(ls) == list(range(1, 26))
    assert sum(list(ls.values())[-5:]) / 5 < sum(list(ls.values())[:5]) / 5 - 1.0  # learns
    assert result["eval"]["documents"] == 3 and result["eval"]["bits_per_byte"] > 0
    # the step hands back the gradient norm as a device tensor; the log holds plain numbers
    norms = [r["grad_norm"] for r in read_log(run / "log.jsonl") if r["kind"] == "train"]
    assert len(norms) == 25 and all(isinstance(n, float) and n > 0 for n in norms)
    for f in ("log.jsonl", "loss.png", "resolved_config.json", "env.json", "checkpoints/latest"):
        assert (run / f).exists(), f
    assert json.loads((run / "resolved_config.json").read_text())["train"]["max_steps"] == 25


def test_packed_training_fills_its_chunks_and_learns(tmp_path, corpus_dir):
    # data.pack: documents back to back in each row (the corpus' documents are 200-2000 bytes,
    # the chunks 32 bytes), memory on
    run = tmp_path / "packed"
    cfg = load_config(ROOT / "configs/tiny.toml",
                      overrides(run, corpus_dir, **{"train.max_steps": 20, "data.pack": True}))
    Trainer(cfg, progress=False).fit()
    records = [r for r in read_log(run / "log.jsonl") if r["kind"] == "train"]
    assert min(r["fill"] for r in records) >= 0.9
    ls = [r["loss"] for r in records]
    assert sum(ls[-5:]) / 5 < sum(ls[:5]) / 5 - 0.5


def test_kept_tokens_train_and_resume_bitwise(tmp_path, corpus_dir):
    # model.kv_keep through the trainer: the kept tokens (carried lane state) and the exploration
    # noise (the RNG) resume exactly from a checkpoint; the kept tokens fill up
    import shutil
    run = tmp_path / "run"
    over = overrides(run, corpus_dir, **{"train.max_steps": 6, "train.ckpt_every": 2,
                                         "train.keep_ckpts": 5, "model.kv_window": 32,
                                         "model.kv_keep": 8})
    cfg = load_config(ROOT / "configs/tiny.toml", over)
    trainer = Trainer(cfg, progress=False)
    trainer.fit()
    ref = losses(run)
    kept = [c.keep_valid for c in trainer.states[0].kv if c is not None]
    assert kept and all(v.any() for v in kept)
    for late in ("step_0000004", "step_0000006"):
        shutil.rmtree(run / "checkpoints" / late)
    (run / "checkpoints" / "latest").write_text("step_0000002\n")
    Trainer(load_config(ROOT / "configs/tiny.toml", over), resume=True, progress=False).fit()
    again = losses(run)
    assert [again[s] for s in range(3, 7)] == [ref[s] for s in range(3, 7)]   # bitwise


def test_the_keep_cost_is_paid_in_the_loss_and_lowers_what_the_kept_tokens_weigh(tmp_path, corpus_dir):
    # model.kv_keep_cost through the trainer: the same run with and without it reads the same
    # first batch with the same weights, so its first loss is higher by exactly the cost of the
    # kept tokens the lanes carry out of the window, charged for the window's tokens; trained
    # on, the kept tokens' mean gate ends lower than without it
    runs = []
    for cost in (0.0, 2.0):
        over = overrides(tmp_path / f"cost{cost}", corpus_dir, **{
            "train.max_steps": 8, "model.kv_window": 32, "model.kv_keep": 8,
            "model.kv_keep_cost": cost})
        trainer = Trainer(load_config(ROOT / "configs/tiny.toml", over), progress=False)
        model = trainer.model
        before = {n: p.detach().clone() for n, p in model.named_parameters() if ".keep_" in n}
        torch.manual_seed(0)
        first = trainer.train_step()
        # the mean kept gate per lane after the first window, by the weights it was read with
        gates = [torch.sigmoid(c.keep_x.float() @ before[f"blocks.{i}.mixer.keep_w"]
                               + before[f"blocks.{i}.mixer.keep_b"]) * c.keep_valid
                 for i, c in enumerate(trainer.states[0].kv) if c is not None]
        per_lane = torch.cat(gates, 1).mean(1).sum().item()
        trainer.fit()
        final = [torch.sigmoid(b.mixer.keep_score(c.keep_x))[c.keep_valid]
                 for b, c in zip(model.blocks, trainer.states[0].kv) if c is not None]
        runs.append((first, per_lane, torch.cat(final).mean().item()))
    (free, lanes0, mean0), (paid, lanes1, mean1) = runs
    assert lanes0 == lanes1 > 0                         # the same first window in both runs
    window = trainer.cfg.model.bptt_chunks * trainer.cfg.train.chunk_len
    charged = (paid["loss"] - free["loss"]) * free["tokens"]
    assert charged == pytest.approx(2.0 * window * lanes0, rel=1e-4)
    assert mean1 < mean0, (mean1, mean0)


def test_length_curriculum_reaches_the_batchers_in_their_batches_and_resumes_bitwise(
        tmp_path, corpus_dir):
    # data.length_curriculum_steps: each lane group's batcher counts bptt_chunks x memory_windows
    # batches a step, so its cap lifts after that many steps; short documents start first; a
    # resumed run continues the same stream, loss for loss
    import shutil
    run = tmp_path / "run"
    over = overrides(run, corpus_dir, **{"train.max_steps": 6, "train.ckpt_every": 3,
                                         "train.keep_ckpts": 5, "train.grad_accum": 2,
                                         "model.bptt_chunks": 2, "model.n_mem": 2,
                                         "train.memory_windows": 2,
                                         "data.length_curriculum_steps": 4,
                                         "data.length_curriculum_start": 400})
    trainer = Trainer(load_config(ROOT / "configs/tiny.toml", over), progress=False)
    assert [(b.curriculum_start, b.curriculum_batches) for b in trainer.batchers] == [(400, 16)] * 2
    trainer.fit()
    assert all(b.batches == 24 and b.length_cap() is None for b in trainer.batchers)
    assert sum(b.skipped_for_length for b in trainer.batchers) > 0
    ref = losses(run)
    shutil.rmtree(run / "checkpoints" / "step_0000006")
    (run / "checkpoints" / "latest").write_text("step_0000003\n")
    Trainer(load_config(ROOT / "configs/tiny.toml", over), resume=True, progress=False).fit()
    again = losses(run)
    assert [again[s] for s in range(4, 7)] == [ref[s] for s in range(4, 7)]   # bitwise
    with pytest.raises(ConfigError, match="data.length_curriculum_start: expected a value > 0"):
        load_config(ROOT / "configs/tiny.toml", [*over, "data.length_curriculum_start=0"])


def test_resume_after_sigkill_is_bitwise_identical(tmp_path, corpus_dir):
    steps = 12
    ref = tmp_path / "ref"
    args = ["train.py", "--config", "configs/tiny.toml", "--no-progress"]
    p = run_cli(args + overrides(ref, corpus_dir, **{"train.max_steps": steps}))
    assert p.wait(timeout=300) == 0, p.stdout.read()

    run = tmp_path / "killed"
    over = overrides(run, corpus_dir, **{"train.max_steps": steps, "train.ckpt_every": 3,
                                         "train.keep_ckpts": 5})
    p = run_cli(args + over)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step_0000006").exists():  # killed mid-run, after 2 checkpoints
        assert p.poll() is None and time.time() < deadline, "run ended before it could be killed"
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (run / "checkpoints" / "step_0000012").exists()
    p = run_cli(args + over + ["--resume"])
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out
    assert "resumed from" in out
    assert losses(run) == losses(ref)  # bitwise: floats compared exactly
    a = load_checkpoint(ref)[1]["optim"]
    b = load_checkpoint(run)[1]["optim"]
    assert json.dumps(a, default=lambda t: t.tolist()) == json.dumps(b, default=lambda t: t.tolist())


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_two_processes_equal_one_process_with_the_same_global_batch(tmp_path, corpus_dir):
    # world 2 x grad_accum 1 reads the same shards as world 1 x grad_accum 2
    one = tmp_path / "one"
    p = run_cli(["train.py", "--config", "configs/tiny.toml", "--no-progress"] +
                overrides(one, corpus_dir, **{"train.grad_accum": 2, "train.eval_every": 4}))
    assert p.wait(timeout=300) == 0, p.stdout.read()
    two = tmp_path / "two"
    p = run_cli(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 "train.py", "--config", "configs/tiny.toml", "--no-progress"] +
                overrides(two, corpus_dir, **{"train.grad_accum": 1, "train.eval_every": 4}))
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    # fp32 sums in a different order: equal to ~1e-6 relative, far below a step's change
    for s in a:
        assert abs(a[s] - b[s]) <= 1e-5 * abs(a[s]), (s, a[s], b[s])
    evals = [{r["step"]: r["loss"] for r in read_log(d / "log.jsonl") if r["kind"] == "eval"}
             for d in (one, two)]
    assert evals[0].keys() == evals[1].keys() == {4, 8}
    for s in evals[0]:
        assert abs(evals[0][s] - evals[1][s]) <= 1e-5 * evals[0][s]


def _stop_worker(rank: int, port: int, args: list, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                      RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from types import SimpleNamespace
    trainer = Trainer(load_config(ROOT / "configs/tiny.toml", args), progress=False)
    try:
        got = []
        for signum in (int(signal.SIGTERM) if rank == 1 else 0, 0):
            trainer.stop_request = SimpleNamespace(signum=signum)   # fit's StopRequest
            out_ = trainer.train_step()
            got.append([out_["stop"], "stop" in out_])
        Path(out, f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_each_step_reduces_the_ranks_stop_signals_with_its_loss(tmp_path, corpus_dir,
                                                                free_port, run_ranks):
    # with several ranks fit no longer agrees on a stop signal by a collective and a wait after
    # every step: train_step reduces each rank's signal (max) with the step's loss, so both ranks
    # read rank 1's SIGTERM from the step it was raised in, and 0 from a step with none
    run_ranks(_stop_worker, (free_port(), overrides(tmp_path / "run", corpus_dir), str(tmp_path)))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == [[int(signal.SIGTERM), True], [0, True]], (rank, got)
    one = Trainer(load_config(ROOT / "configs/tiny.toml", overrides(tmp_path / "one", corpus_dir)),
                  progress=False)
    try:
        assert "stop" not in one.train_step()   # one process: fit reads its own StopRequest
    finally:
        one.close()


# ---------------------------------------------------------------------------- failures
def test_non_finite_losses_skip_steps_then_stop_with_checkpoint_intact(tmp_path, corpus_dir):
    run = tmp_path / "nan"
    cfg = load_config(ROOT / "configs/tiny.toml", overrides(
        run, corpus_dir, **{"train.max_steps": 20, "train.ckpt_every": 2, "train.max_bad_steps": 3}))
    trainer = Trainer(cfg, progress=False)
    forward = trainer.model.forward
    poison = {"on": False, "calls": 0}

    def poisoned(*args, **kw):
        out, state = forward(*args, **kw)
        if poison["on"]:
            poison["calls"] += 1
            # one bad step (both chunks), then good again, then bad for good
            if poison["calls"] > 2 * cfg.model.bptt_chunks:
                out = out * float("nan")
            elif poison["calls"] <= cfg.model.bptt_chunks:
                out = out * float("inf")
        return out, state
    trainer.model.forward = poisoned
    for _ in range(4):
        trainer.train_step()
    trainer.save()
    saved = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    poison["on"] = True
    trainer.model.forward = poisoned
    with pytest.raises(TrainingStopped, match="3 consecutive steps had a non-finite loss"):
        trainer.fit()
    assert trainer.skipped_steps == 4  # one isolated, then three in a row
    meta, _ = load_checkpoint(run)
    assert meta["step"] == 6  # the last good step; bad steps 7-9 wrote nothing
    current = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert not all(torch.equal(current[k], saved[k]) for k in saved)  # step 6 did update
    load_checkpoint(run, trainer.model)  # skipped steps never touched the weights
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, current[k]) and torch.isfinite(v).all(), k


def test_corrupt_and_mismatched_checkpoints_are_refused(tmp_path, corpus_dir, capsys):
    run = tmp_path / "run"
    over = overrides(run, corpus_dir, **{"train.max_steps": 2})
    assert train_cli.main(["--config", "configs/tiny.toml", "--no-progress", *over]) == 0
    # a different model cannot resume it
    assert train_cli.main(["--config", "configs/tiny.toml", "--resume", *over, "model.d_model=96",
                           "model.mamba_head_dim=32"]) == 2
    assert "model config differs" in capsys.readouterr().err
    # a flipped byte in the weights
    ckpt = run / "checkpoints" / "step_0000002"
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[-5] ^= 0xFF
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    assert train_cli.main(["--config", "configs/tiny.toml", "--resume", *over]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "corrupt" in err and "\n" not in err
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "nowhere")
    assert train_cli.main(["--config", "configs/tiny.toml", "--resume",
                           *overrides(tmp_path / "empty", corpus_dir)]) == 2
    assert "checkpoint not found" in capsys.readouterr().err


def test_a_model_setting_added_later_is_taken_at_its_default_from_an_older_checkpoint():
    from elephant.checkpoint import check_model_config
    from elephant.config import ModelConfig
    cfg = ModelConfig(kv_window=8, kv_keep=4).to_dict()
    older = {k: v for k, v in cfg.items() if k != "kv_keep_drop"}   # written before the key existed
    check_model_config({"config": {"model": older}}, cfg, "ckpt", "hint")
    with pytest.raises(CheckpointError, match=r"model.kv_keep_drop=0.0 there, 0.1 here"):
        check_model_config({"config": {"model": older}}, cfg | {"kv_keep_drop": 0.1}, "ckpt", "hint")
    with pytest.raises(CheckpointError, match=r"^ckpt: .*d_model=512 there, 96 here.*; hint$"):
        check_model_config({"config": {"model": cfg}}, cfg | {"d_model": 96}, "ckpt", "hint")
    # a new stage may change how the model trains, not what it computes
    free = frozenset({"kv_keep_drop", "bptt_chunks"})
    check_model_config({"config": {"model": cfg}}, cfg | {"kv_keep_drop": 0.1, "bptt_chunks": 4},
                       "ckpt", "hint", free)
    with pytest.raises(CheckpointError, match=r"kv_keep=4 there, 8 here"):
        check_model_config({"config": {"model": cfg}}, cfg | {"kv_keep_drop": 0.1, "kv_keep": 8},
                           "ckpt", "hint", free)


def test_a_new_stage_may_not_change_a_held_x0_gain(tmp_path):
    # attn_x0_init is where a learned gain starts (a new stage may change it, as it changes
    # nothing the weights compute), but a held gain's value (attn_x0_gain "fixed", a buffer in
    # the checkpoint): changed at a new stage it would be loaded over without a word, so it is
    # refused by name
    from elephant.checkpoint import init_from, save_checkpoint
    from elephant.config import TRAINING_ONLY_MODEL_KEYS, ModelConfig, stage_free_keys
    from elephant.model import ElephantLM
    for gain, free in (("channel", True), ("layer", True), ("fixed", False)):
        cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=2, layers="MA", d_mlp=32, d_state=16,
                          mamba_head_dim=16, attn_x0=True, attn_x0_init=0.25, attn_x0_gain=gain)
        assert ("attn_x0_init" in stage_free_keys(cfg.to_dict())) == free
        assert stage_free_keys(cfg.to_dict()) <= TRAINING_ONLY_MODEL_KEYS
        ckpt = save_checkpoint(tmp_path / gain, 1, ElephantLM(cfg), {},
                               {"config": {"model": cfg.to_dict()}})
        other = cfg.to_dict() | {"attn_x0_init": 0.5}
        if free:
            init_from(ckpt, ElephantLM(ModelConfig(**other)), other)
        else:
            with pytest.raises(CheckpointError, match=r"attn_x0_init=0.25 there, 0.5 here"):
                init_from(ckpt, ElephantLM(ModelConfig(**other)), other)
    # without attn_x0 the key computes nothing, and stays free
    assert "attn_x0_init" in stage_free_keys(ModelConfig(attn_x0_gain="fixed").to_dict())


def test_init_from_starts_a_new_stage_from_another_runs_weights(tmp_path, corpus_dir, capsys):
    # a curriculum's next stage: the weights of run A, a fresh optimizer, data stream and step count
    first = tmp_path / "a"
    over = overrides(first, corpus_dir, **{"train.max_steps": 4})
    a = Trainer(load_config(ROOT / "configs/tiny.toml", over), progress=False)
    a.fit()
    second = tmp_path / "b"
    b = Trainer(load_config(ROOT / "configs/tiny.toml", overrides(   # training-only keys may change
        second, corpus_dir, **{"train.max_steps": 3, "train.init_from": str(first),
                               "data.pack": True, "model.bptt_chunks": 3})), progress=False)
    assert b.step == 0 and all(torch.equal(p, q) for p, q in zip(a.model.parameters(),
                                                                 b.model.parameters()))
    b.fit()
    assert sorted(losses(second)) == [1, 2, 3]
    # its first loss is the trained model's, not a fresh one's
    fresh = tmp_path / "fresh"
    Trainer(load_config(ROOT / "configs/tiny.toml", overrides(
        fresh, corpus_dir, **{"train.max_steps": 1, "data.pack": True})), progress=False).fit()
    assert losses(second)[1] < losses(fresh)[1] - 0.5
    # another model cannot start from it: a one-line error
    assert train_cli.main(["--config", "configs/tiny.toml", "--no-progress", *overrides(
        tmp_path / "c", corpus_dir, **{"train.init_from": str(first), "model.d_model": 96,
                                       "model.mamba_head_dim": 32})]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: train.init_from=") and "model config differs" in err


def test_packed_train_step_equals_the_per_chunk_boundary_path(tmp_path, corpus_dir):
    # the trainer's packed step (the boundary path only for chunks with an inner start, the initial
    # memory's prefix once per step, carried by the state) gives the loss and gradients of feeding every chunk its
    # `starts` with the prefix computed in each chunk; parameters held fixed over 8 steps
    from data_packing import RollingChunkBatcher
    run = tmp_path / "packed_eq"
    cfg = load_config(ROOT / "configs/tiny.toml",
                      overrides(run, corpus_dir, **{"data.pack": True, "optim.grad_clip": 0,
                                                    "train.chunk_len": 64}))
    tr = Trainer(cfg, progress=False)
    model, t = tr.model, cfg.train
    ref_batcher = RollingChunkBatcher(tr.train_corpus, lanes=t.lanes, chunk_len=t.chunk_len,
                                      seed=t.seed, pack=True)
    ref_batcher.load_state_dict(tr.batchers[0].state_dict())
    grads = []
    tr.opt.step = lambda: grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                                        if p.grad is not None})
    state, inner = model.init_state(t.lanes), []
    try:
        for _ in range(8):
            out = tr.train_step()
            batches = [next(ref_batcher) for _ in range(cfg.model.bptt_chunks)]
            inner += [b.inner_starts for b in batches]
            count = sum(int(b.loss_mask.sum()) for b in batches)
            loss = 0.0
            for b in batches:
                state.prefix = None   # the prefix computed in each chunk, not carried
                nll, state = model(b.tokens[:, :-1], state, b.reset, targets=b.tokens[:, 1:],
                                   loss_mask=b.loss_mask, reduction="sum", starts=b.starts)
                loss = loss + nll
            model.zero_grad()
            (loss / count).backward()
            state = state.detach()
            assert abs(out["loss"] - loss.item() / count) < 1e-5 * abs(out["loss"])
            for name, g in grads[-1].items():
                assert (g - model.get_parameter(name).grad).abs().max() < 1e-5 * g.abs().max() + 1e-9, name
            model.zero_grad(set_to_none=True)  # the next train_step starts from no gradient
    finally:
        tr.close()
    assert 0 < sum(inner) < len(inner)  # both kinds of chunk were seen


def test_memory_windows_step_equals_answer_step_with_the_memory_path(tmp_path, corpus_dir):
    # train.memory_windows = 3: a step is 3 BPTT windows, each backpropagated alone, with the
    # memory path across them. Its gradients equal elephant.recall.answer_step's on the same
    # chunks (windows of bptt_chunks, memory path on), and differ from the same windows without
    # the path; parameters held fixed over 3 steps.
    from data_packing import RollingChunkBatcher
    from elephant.recall import answer_step
    run = tmp_path / "windows"
    cfg = load_config(ROOT / "configs/tiny.toml",
                      overrides(run, corpus_dir, **{"optim.grad_clip": 0, "train.memory_windows": 3}))
    tr = Trainer(cfg, progress=False)
    model, t, k = tr.model, cfg.train, cfg.model.bptt_chunks
    ref_batcher = RollingChunkBatcher(tr.train_corpus, lanes=t.lanes, chunk_len=t.chunk_len,
                                      seed=t.seed)
    ref_batcher.load_state_dict(tr.batchers[0].state_dict())
    grads = []
    tr.opt.step = lambda: grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                                        if p.grad is not None})
    state = model.init_state(t.lanes)
    try:
        for _ in range(3):
            out = tr.train_step()
            chunks = [(b.tokens, b.loss_mask, b.reset) for b in
                      (next(ref_batcher) for _ in range(3 * k))]
            model.zero_grad(set_to_none=True)
            loss, _ = answer_step(model, chunks, state, window=k, memory_path=False)
            no_path = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            loss, state = answer_step(model, chunks, state, window=k, memory_path=True)
            assert abs(out["loss"] - loss) < 1e-5 * abs(out["loss"])
            for name, g in grads[-1].items():
                ref = model.get_parameter(name).grad
                assert (g - ref).abs().max() < 1e-5 * g.abs().max() + 1e-9, name
            assert not torch.allclose(no_path["mem_gate"], grads[-1]["mem_gate"])
            model.zero_grad(set_to_none=True)
    finally:
        tr.close()


@pytest.mark.parametrize("pack", [False, True])
def test_whole_model_compile_traces_without_graph_breaks_and_trains_the_same(tmp_path, corpus_dir,
                                                                           monkeypatch, pack):
    # train.compile=model compiles the whole chunk step (forward, glue, loss) as one graph; traced
    # here with the aot_eager backend: no graph break, a handful of graphs for the whole run (not
    # one per chunk or step), and the same losses and weights as the eager trainer over 5 steps.
    # train.compile=graphs, the same with the trainer's CUDA-graph steps (each window marked, the
    # state cloned past it, the update compiled; the backend here has no graphs,
    # tests/test_gpu_packing.py and tests/test_gpu_optim.py have them); window, the same with
    # each window's chunks as one graph (ElephantLM.forward_window)
    import torch._dynamo
    from torch._dynamo.utils import counters
    from elephant import model as model_mod
    monkeypatch.setattr(model_mod, "COMPILE_BACKEND", "aot_eager")
    runs = {}
    # packed: off and window only (~45 s less of the CPU suite). window compiles the same `_chunk`
    # as model and graphs, plus the window's; packed CUDA-graph steps per chunk and per window are
    # held to the eager ones on the GPU (tests/test_gpu_packing.py)
    modes = ("off", "window") if pack else ("off", "model", "graphs", "window")
    for mode in modes:
        # one block of each kind: a deeper stack adds tracing time, not paths
        cfg = load_config(ROOT / "configs/tiny.toml",
                          overrides(tmp_path / mode, corpus_dir, **{"train.compile": mode,
                                                                    "data.pack": pack,
                                                                    "model.layers": "MA"}))
        torch._dynamo.reset()
        counters.clear()
        tr = Trainer(cfg, progress=False)
        try:
            runs[mode] = ([tr.train_step()["loss"] for _ in range(5)],
                          {n: p.detach().clone() for n, p in tr.model.named_parameters()})
        finally:
            tr.close()
        if mode != "off":
            assert not counters["graph_break"], dict(counters["graph_break"])
            # graphs: one more, the clipping and optimizer update (Optimizers.graphed_step)
            assert 1 <= counters["stats"]["unique_graphs"] <= (6 if mode == "model" else 7)
    eager_losses, eager_w = runs["off"]
    for mode in modes[1:]:
        losses_, w = runs[mode]
        assert torch.allclose(torch.tensor(losses_), torch.tensor(eager_losses), rtol=1e-4), \
            (mode, losses_, eager_losses)
        for name, p in eager_w.items():
            assert torch.allclose(w[name], p, rtol=1e-3, atol=1e-5), (mode, name)


def test_cuda_graph_lane_groups_train_as_the_eager_trainer(tmp_path, corpus_dir, monkeypatch):
    # train.compile=window|graphs with grad_accum=2: the lane groups take turns on the same graphs,
    # each group's state cloned and its gradients set aside after its window, their sum given back
    # for the update. Traced here with aot_eager (no graphs, so nothing is overwritten: this holds
    # the arithmetic, the setting aside and taking back; tests/test_gpu_trainer.py the replays):
    # the same losses and weights as the eager trainer with the same two groups
    import torch._dynamo
    from elephant import model as model_mod
    monkeypatch.setattr(model_mod, "COMPILE_BACKEND", "aot_eager")
    runs = {}
    for mode in ("off", "window"):
        cfg = load_config(ROOT / "configs/tiny.toml", overrides(
            tmp_path / mode, corpus_dir, **{"train.compile": mode, "train.grad_accum": 2,
                                            "model.layers": "MA"}))
        torch._dynamo.reset()
        tr = Trainer(cfg, progress=False)
        try:
            assert (tr.aside_grads is not None) == (mode == "window")
            runs[mode] = ([tr.train_step()["loss"] for _ in range(3)],
                          {n: p.detach().clone() for n, p in tr.model.named_parameters()})
            if mode == "window":   # nothing left aside after a step
                assert tr.aside_grads == {}
        finally:
            tr.close()
    (eager_losses, eager_w), (losses_, w) = runs["off"], runs["window"]
    assert torch.allclose(torch.tensor(losses_), torch.tensor(eager_losses), rtol=1e-4), \
        (losses_, eager_losses)
    for name, p in eager_w.items():
        assert torch.allclose(w[name], p, rtol=1e-3, atol=1e-5), name


def test_auto_compile_takes_the_window_graphs_on_cuda_where_steps_can_replay_them():
    # train.compile=auto: nothing on the CPU; on CUDA a BPTT window as one CUDA graph, unless the
    # caller's steps cannot replay graphs (memory_windows > 1, the recall trainer): each block
    from elephant.trainer import compile_mode
    assert compile_mode("auto", "cpu") == "off"
    assert compile_mode("auto", "cuda") == "window"
    assert compile_mode("auto", "cuda:1", graphs=False) == "blocks"
    for setting, mode in (("on", "blocks"), ("model", "model"), ("graphs", "graphs"),
                          ("window", "window"), ("off", "off")):
        assert compile_mode(setting, "cuda") == mode == compile_mode(setting, "cpu", graphs=False)


def test_the_trainer_allows_auto_its_cuda_graphs_only_with_one_memory_window(
        tmp_path, corpus_dir, monkeypatch):
    # what Trainer tells compile_mode: CUDA graphs (auto -> window) only where its steps can replay
    # them; recorded on the CPU, where auto compiles nothing either way
    from elephant import trainer as trainer_mod
    seen = []
    real = trainer_mod.compile_mode
    monkeypatch.setattr(trainer_mod, "compile_mode",
                        lambda setting, device, graphs=True: seen.append(graphs) or
                        real(setting, device, graphs))
    for i, extra in enumerate(({}, {"train.grad_accum": 2}, {"train.memory_windows": 2})):
        cfg = load_config(ROOT / "configs/tiny.toml", overrides(
            tmp_path / f"run{i}", corpus_dir, **{"train.compile": "auto", **extra}))
        Trainer(cfg, progress=False).close()
    assert seen == [True, True, False]


def test_cuda_graph_training_refuses_memory_only_backpropagation():
    # it keeps what a backward left in the CUDA graphs' memory past the next replay: the memory of
    # earlier windows (lane groups are served: test_cuda_graph_lane_groups_train_as_the_eager_trainer)
    from elephant.config import ConfigError, TrainConfig
    for mode in ("graphs", "window"):
        TrainConfig(compile=mode).validate()
        TrainConfig(compile=mode, grad_accum=2).validate()
        with pytest.raises(ConfigError, match="memory_windows"):
            TrainConfig(compile=mode, memory_windows=2).validate()
    TrainConfig(compile="auto", memory_windows=2).validate()   # auto compiles each block then


def test_training_graphs_serve_training_with_gradients_only():
    # compile_for("graphs"): the CUDA-graph form for a training step with gradients, the plain
    # compiled form for evaluation, generation and no-grad calls
    from elephant.compile import TrainingGraphs
    calls = []
    model = torch.nn.Linear(2, 2)
    fn = TrainingGraphs(model, lambda: calls.append("graphs"), lambda: calls.append("plain"))
    fn()
    with torch.no_grad():
        fn()
    model.eval()
    fn()
    assert calls == ["graphs", "plain", "plain"]


@pytest.mark.parametrize("groups", [1, 2])
def test_the_loss_is_read_after_the_backward_is_queued_and_before_the_update(tmp_path, corpus_dir,
                                                                             groups):
    # one window per lane group: the loss goes to the host without a wait after the last group's
    # forward pass, its backward is queued, and only then does the step read the loss, once, before
    # it queues the update (so on a GPU neither the gap before the backward nor the optimizer's
    # launches leave it idle); a non-finite loss has run its backward but skips the update and its
    # gradients
    cfg = load_config(ROOT / "configs/tiny.toml", overrides(tmp_path / "early", corpus_dir,
                                                            **{"train.grad_accum": groups}))
    trainer = Trainer(cfg, progress=False)
    try:
        events = []
        real_tolist = torch.Tensor.tolist

        def tolist(t):
            events.append("read")
            return real_tolist(t)
        weight = trainer.model.embed.weight
        weight.register_hook(lambda g: events.append("backward") or g)
        step = trainer.opt.step
        trainer.opt.step = lambda: events.append("update") or step()
        forward = trainer.model.forward
        poison = {"on": False}

        def poisoned(*args, **kw):
            out, state = forward(*args, **kw)
            return (out * float("nan") if poison["on"] else out), state
        trainer.model.forward = poisoned
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.Tensor, "tolist", tolist)
            out = trainer.train_step()
            assert events == ["backward"] * groups + ["read", "update"], events
            assert math.isfinite(out["loss"]) and "skipped" not in out
            before = weight.detach().clone()
            events.clear()
            poison["on"] = True
            out = trainer.train_step()
        assert out["skipped"] and events == ["backward"] * groups + ["read"], events   # no update
        assert torch.equal(weight.detach(), before)
        assert all(p.grad is None for p in trainer.model.parameters())
    finally:
        trainer.close()
