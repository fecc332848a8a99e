"""In-context copying learned by the LM loss: a tiny hybrid (Mamba + attention) learns to copy
from its own chunk as an attention-only stack of the same size does (issue 56).

Each training row is one chunk of 64 bytes: 32 random letters, then the same 32 again. Only the
second half can be predicted, and only by copying from the first: a stack that cannot copy stays
at chance (1 in 16). The loss is on every byte, as train.py trains; the optimizers are the
project's own (Muon for the hidden matrices, Adam for the rest). GPU studies of the same question
at the recipes' widths, with real text around the fact (where the hybrid needs model.attn_x0):
benchmarks/copy_study.py, docs/RESULTS.md.
"""
import json
import random

import pytest
import torch

from elephant.config import ModelConfig, OptimConfig
from elephant.model import ElephantLM
from elephant.optim import build_optimizers

T = 64
LETTERS = b"abcdefghijklmnop"


def repeated_halves(rng: random.Random, rows: int) -> torch.Tensor:
    """(rows, T + 1) bytes: a random half of T // 2 letters, twice, and one letter more."""
    out = []
    for _ in range(rows):
        half = bytes(rng.choice(LETTERS) for _ in range(T // 2))
        out.append(list(half + half + bytes([rng.choice(LETTERS)])))
    return torch.tensor(out)


def copy_accuracy(model: ElephantLM, rows: int = 256) -> float:
    """Next-byte accuracy on the second half (from its second byte: the first is where the
    repeat starts, which nothing in the chunk says)."""
    x = repeated_halves(random.Random(123), rows)
    with torch.no_grad():
        logits, _ = model(x[:, :-1])
    pred = logits.argmax(-1)                       # pred[:, t] guesses byte t + 1
    half = T // 2
    return (pred[:, half:T - 1] == x[:, half + 1:T]).float().mean().item()


def train_on_every_byte(layers: str, steps: int = 500, seed: int = 0, **model) -> float:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=128, d_model=32, n_heads=2, layers=layers, d_mlp=64, d_state=16,
                      mamba_head_dim=16, ssd_chunk=16, **model)
    model = ElephantLM(cfg)
    opt = build_optimizers(model, OptimConfig(warmup_steps=20, momentum_warmup_steps=20,
                                              adam_lr=0.003, embed_lr=0.003, head_lr=0.003))
    rng = random.Random(seed)
    for step in range(steps):
        opt.set_step(step, steps)
        x = repeated_halves(rng, 16)
        loss, _ = model(x[:, :-1], targets=x[:, 1:])
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    model.eval()
    return copy_accuracy(model)


def test_hybrid_learns_in_chunk_copying_as_attention_only_does():
    # 500 steps: both stacks 1.000 with each of seeds 0, 1, 2, 3 (2026-11-29); chance is 0.06.
    # The hybrid also as the recipes build it, its attention reading the token embeddings
    # (model.attn_x0: among real text, at the recipes' widths, the bare hybrid did not copy)
    learned = {layers: train_on_every_byte(layers) for layers in ("MA", "AA")}
    learned["MA, attn_x0"] = train_on_every_byte("MA", attn_x0=True)
    assert learned["AA"] > 0.95, learned
    for hybrid in ("MA", "MA, attn_x0"):
        assert learned[hybrid] > 0.95, learned
        assert learned[hybrid] >= learned["AA"] - 0.02, learned


def test_copy_accuracy_is_at_chance_for_an_untrained_model():
    torch.manual_seed(0)
    model = ElephantLM(ModelConfig(vocab_size=128, d_model=32, n_heads=2, layers="MA", d_mlp=64,
                                   d_state=16, mamba_head_dim=16, ssd_chunk=16)).eval()
    assert copy_accuracy(model) < 0.2


def test_copy_study_scores_past_the_window_at_its_last_checkpoint_only(tmp_path, monkeypatch):
    # benchmarks/copy_study.py: every checkpoint at the shortest distance (when the run first
    # copies), the newest also at the long ones (a 64K distance is a 64K-byte pass per lane)
    import elephant.hub
    import elephant.recall
    from benchmarks.copy_study import score
    from elephant.config import ConfigError
    for step in (100, 200, 300):
        (tmp_path / "checkpoints" / f"step_{step:07d}").mkdir(parents=True)
    asked = {}

    def load(ckpt, device, kv_keep=None, kv_keep_read=None):
        name = "" if kv_keep is None else f"kept{kv_keep}" + (f"/{kv_keep_read}" if kv_keep_read else "")
        return (ckpt / name if name else ckpt), None, \
            {"train": {"chunk_len": 64}, "data": {}}

    def recall(model, tokenizer, distances, *args, ablation="none", **kw):
        if ablation == "delta":   # a part the model does not carry
            raise ConfigError("--ablate delta: this model carries no delta")
        asked[model.name if ablation == "none" else (model.name, ablation)] = list(distances)
        return {"by_distance": {elephant.recall.label(d): {"accuracy": d / 1e5, "held": d / 1e6}
                                for d in distances}, "tokens_per_s": 1000.4 * len(distances)}
    monkeypatch.setattr(elephant.hub, "from_pretrained", load)
    monkeypatch.setattr(elephant.recall, "evaluate_recall", recall)
    monkeypatch.delenv("COPY_CORPUS", raising=False)
    rows = score(tmp_path, "cpu", [4096, 128, 65536], lanes=4)
    assert [r["step"] for r in rows] == [100, 200, 300]
    assert asked == {"step_0000100": [128], "step_0000200": [128],
                     "step_0000300": [4096, 128, 65536]}
    # with the share of the fact's value the kept tokens held at each distance
    assert rows[-1] == {"step": 300, "128": 0.00128, "4K": 0.04096, "64K": 0.65536,
                        "128 held": 0.000128, "4K held": 0.004096, "64K held": 0.065536,
                        "tok/s": 3001}   # the pass's speed
    asked.clear()   # --every-distances: these at every checkpoint too
    score(tmp_path, "cpu", [4096, 128, 65536], lanes=4, every=[4096])
    assert asked["step_0000100"] == asked["step_0000200"] == [128, 4096]
    asked.clear()   # --ablate: the last checkpoint again past the shortest distance, each part dropped
    rows = score(tmp_path, "cpu", [4096, 128, 65536], lanes=4, ablate=["memory", "delta", "keep"])
    assert asked[("step_0000300", "memory")] == asked[("step_0000300", "keep")] == [4096, 65536]
    assert len(asked) == 5 and rows[-1]["64K without memory"] == 0.65536 and "4K without keep" in rows[-1]
    assert not any("without delta" in k for k in rows[-1])   # not carried: left out, not failed
    asked.clear()   # --keep-eval: the last checkpoint again past the shortest distance, more kept tokens
    passes = []     # scored: the rows so far after every pass (what a call cut short returns)
    rows = score(tmp_path, "cpu", [4096, 128, 65536], lanes=4, keep_eval=[512, 2048],
                 scored=lambda rows: passes.append([dict(r) for r in rows]))
    assert len(passes) == 5 and passes[-1] == rows and [len(p) for p in passes] == [1, 1, 1, 2, 3]
    assert "64K with 512 kept" in passes[1][0] and "64K with 2048 kept" not in passes[1][0]
    assert asked["kept512"] == asked["kept2048"] == [4096, 65536] and len(asked) == 5
    assert rows[-1]["64K with 2048 kept"] == 0.65536 and "4K with 512 kept" in rows[-1]
    assert rows[-1]["tok/s with 2048 kept"] == 2001
    asked.clear()   # "K/R": K kept tokens, each query reading R of them
    rows = score(tmp_path, "cpu", [128, 65536], lanes=4, keep_eval=["4096/32"])
    assert asked["32"] == [65536] and rows[-1]["64K with 4096 kept reading 32"] == 0.65536


def test_copy_study_saves_a_runs_weights_in_parts_that_a_later_call_scores(tmp_path, monkeypatch):
    # COPY_WEIGHTS: the newest checkpoint's weights and meta.json, in parts small enough to come
    # back from the device machine, named without "@"; load_weights puts them back byte for byte
    import benchmarks.copy_study as study
    monkeypatch.setattr(study, "PART", 1000)
    run = tmp_path / "run"
    for step, size in ((100, 10), (200, 5000)):
        ckpt = run / "checkpoints" / f"step_{step:07d}"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(json.dumps({"step": step}))
        (ckpt / "model.safetensors").write_bytes(random.Random(step).randbytes(size))
        (ckpt / "rank0.safetensors").write_bytes(b"optimizer")   # not needed to score: left out
    folder = study.save_weights(run, tmp_path / "out", "hybrid@4")
    assert folder.name == "w-hybrid-s4" and len(list(folder.glob("part.*"))) > 1
    assert all(f.stat().st_size <= 1000 for f in folder.iterdir())
    ckpt = study.load_weights(folder, tmp_path / "again")
    assert ckpt == tmp_path / "again" / "checkpoints" / "step_0000200"
    assert sorted(f.name for f in ckpt.iterdir()) == ["meta.json", "model.safetensors"]
    for f in ckpt.iterdir():
        assert f.read_bytes() == (run / "checkpoints" / "step_0000200" / f.name).read_bytes()
    with pytest.raises(FileNotFoundError, match="no part"):
        study.load_weights(tmp_path / "out", tmp_path / "x")


def test_copy_study_variant_names_carry_a_seed():
    # "hybrid@2": the variant's own overrides and hooks, and train.seed=2 placed after the command
    # line's overrides (so that seeds of one variant train side by side); a bad name is refused
    from benchmarks.copy_study import VARIANTS, variant
    assert variant("mamba-zero") == ("mamba-zero", [], ["zero_mamba"], [])
    assert variant("x0-fixed@2") == ("x0-fixed", VARIANTS["x0-fixed"][0], [], ["train.seed=2"])
    for bad in ("nothing", "hybrid@", "hybrid@two", "nothing@1"):
        with pytest.raises(KeyError):
            variant(bad)


def test_a_recipes_model_taken_whole_into_the_recall_recipe():
    # the shape wt103-70m-model-recall-text: configs/recall.toml with every model setting of
    # wt103-70m (its defaults too, so none of recall.toml's own model settings survives), the
    # byte vocabulary aside; the delta variant's layers
    from benchmarks.copy_study import ROOT, SHAPES, every_second_mamba_delta
    from elephant.config import load_config
    shape = SHAPES["wt103-70m-model-recall-text"]
    got = load_config(ROOT / shape[1], shape[2:])
    want = load_config(ROOT / "configs" / "wt103-70m.toml").model
    recall = load_config(ROOT / "configs" / "recall.toml")
    assert got.model.vocab_size == recall.model.vocab_size
    assert vars(got.model) | {"vocab_size": want.vocab_size} == vars(want)
    assert got.data.source == "recall" and got.train.lanes == recall.train.lanes
    assert every_second_mamba_delta("MAMAMA") == "MADAMA"
    assert every_second_mamba_delta("MAMMAMMA") == "MADMADMA"
    assert every_second_mamba_delta("AA") == "AA"


def test_long_study_pairs_each_variant_with_todays_run_at_its_seed():
    from benchmarks.long_study import paired, split_seed
    assert split_seed("keep-read@3") == ("keep-read", "3") and split_seed("today") == ("today", "")
    for bad in ("nothing", "today@x"):
        with pytest.raises(SystemExit):
            split_seed(bad)
    loss = lambda x: {"test": {"nats_per_byte": x}}   # noqa: E731
    out = paired({"today@1": loss(0.50), "nomem@1": loss(0.502), "today@2": loss(0.51),
                  "nomem@2": loss(0.509), "nomem@3": loss(0.4)})   # @3 has no pair: left out
    assert out["nomem"]["by_seed"] == pytest.approx({"1": 0.002, "2": -0.001})
    assert out["nomem"]["mean"] == pytest.approx(0.0005)
    assert "today" not in out


def test_copy_study_parallel_starts_a_variant_only_as_another_ends(tmp_path):
    # --parallel 1: the second variant's run starts after the first has trained and scored (four
    # variants of wt103-70m's width at once outgrew an 80 GB GPU); both end with their results
    import subprocess
    import sys

    from benchmarks.copy_study import ROOT
    out, runs = tmp_path / "out", tmp_path / "runs"
    subprocess.run([sys.executable, "benchmarks/copy_study.py", "--cpu-smoke", "--parallel", "1",
                    "--variants", "hybrid,attn", "--steps", "1", "--ckpt-every", "1",
                    "--distances", "64", "--out", str(out), "--runs", str(runs),
                    f"data.cache_dir={tmp_path / 'cache'}"], cwd=ROOT, check=True,
                   capture_output=True, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert {n: v["returncode"] for n, v in summary["variants"].items()} == {"hybrid": 0, "attn": 0}
    first_done = (out / "hybrid.json").stat().st_mtime
    assert first_done <= (runs / "attn" / "env.json").stat().st_mtime


def test_long_study_worth_of_the_parts_a_variant_carries():
    # score --drops drops only the parts a variant carries (the recipes have no memory since
    # 2026-12-07): the parts' and the context's worth are reported all the same, memory_worth
    # only where there was a memory to drop
    from benchmarks.long_study import worth
    bands = lambda x: {"bands": {"8K-16K": x, "16K-32K": x + 0.02, "0-512": 9.0}}   # noqa: E731
    long = {"carried": bands(0.5), "reset-2K": bands(0.53), "drop-window": bands(0.6),
            "drop-kept": bands(0.49)}
    got = worth(long)
    assert "memory_worth_8k_32k" not in got
    assert got["part_worth_8k_32k"] == pytest.approx({"window": 0.1, "kept": -0.01})
    assert got["context_gain_8k_32k"] == pytest.approx(0.03)
    assert worth(long | {"drop-memory": bands(0.5004)})["memory_worth_8k_32k"] == pytest.approx(0.0004)
    assert worth({"carried": bands(0.5)}) == {}   # scored without --drops


def study_args(tmp_path):
    """long_study's arguments for config(): bytes, runs and cache in tmp_path, 10 steps."""
    import argparse
    return argparse.Namespace(tokenizer="bytes", cache=str(tmp_path), steps=10, runs=str(tmp_path),
                              smoke=False)


def train_settings(cfg) -> dict:
    """A config's train section but its run dir (each variant's own)."""
    return {k: v for k, v in vars(cfg.train).items() if k != "run_dir"}


def test_long_study_today_is_the_recipe_and_the_other_variants_start_from_before(tmp_path):
    # the recipe took keep-mix-varied's training on 2026-12-07: `today` (the recipe as it is) is
    # that variant read with the 128 kept tokens it trained with, and the variants defined
    # before then keep their meaning by starting from the recipe as it was (`before`)
    from benchmarks.long_study import config
    args = study_args(tmp_path)
    today, mixed = config("today", args), config("keep-mix-varied", args)
    assert mixed.model.kv_keep_infer == 4096 and today.model.kv_keep_infer == 0
    mixed.model.kv_keep_infer = 0
    assert vars(mixed.model) == vars(today.model) and today.model.kv_keep_cost == 0.01
    assert vars(mixed.data) == vars(today.data) and train_settings(mixed) == train_settings(today)
    before = config("before", args)
    assert before.data.recall_mix == 0 and before.model.kv_keep_cost == 0
    assert before.data.length_curriculum_steps == 0
    tf = config("transformer", args)   # beside the recipe, on the recipe's data
    assert vars(tf.data) | {"pack": False} == vars(today.data) and tf.data.pack   # its rows packed
    assert tf.model.layers == "AAAAAAAA"
    # the same tokens a step: 4 lanes of 8,192 against 32 of 512 through 2 chunks
    assert tf.train.chunk_len * tf.train.lanes == today.train.lanes * 512 * today.model.bptt_chunks
    # the recipe reaching further back: the recipe as it is with that one setting changed
    for name, key, value in (("keep512", "kv_keep", 512), ("window2k", "kv_window", 2048),
                             ("window8k", "kv_window", 8192), ("assoc", "kv_assoc", True)):
        far = config(name, args)
        assert getattr(far.model, key) == value != getattr(today.model, key)
        assert vars(far.model) | {key: getattr(today.model, key)} == vars(today.model)
        assert vars(far.data) == vars(today.data) and train_settings(far) == train_settings(today)


def test_long_study_imports_an_earlier_score_and_keeps_its_own(tmp_path):
    from benchmarks.long_study import import_scores
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"variants": {"transformer": {"test": {"nats_per_byte": 0.5}},
                                                "today": {"test": {"nats_per_byte": 0.4}}}}))
    runs = tmp_path / "runs"
    (runs / "today").mkdir(parents=True)
    (runs / "today" / "score.json").write_text('{"test": {"nats_per_byte": 0.3}}')
    args = study_args(runs)
    args.variant, args.from_, args.kv_keep = "transformer,today", str(earlier), 0
    assert import_scores(args) == 0
    tf = json.loads((runs / "transformer" / "score.json").read_text())
    assert tf["test"]["nats_per_byte"] == 0.5 and tf["imported_from"] == "earlier.json"
    assert json.loads((runs / "today" / "score.json").read_text())["test"]["nats_per_byte"] == 0.3
    args.variant = "window8k"
    with pytest.raises(SystemExit, match="no score of 'window8k'"):
        import_scores(args)
    args.from_ = str(tmp_path / "missing.json")
    with pytest.raises(SystemExit, match="not a file"):
        import_scores(args)


def test_long_study_with_mix_is_what_wt103_took_on_any_recipe(tmp_path):
    # `with-mix` reads the recall training from configs/wt103-70m.toml: on that recipe it is
    # `today`; on fineweb-124m (--recipe) it is fineweb's model and steps with that training
    from benchmarks.long_study import TOOK, config
    args = study_args(tmp_path)
    today, mixed = config("today", args), config("with-mix", args)
    assert vars(today.model) == vars(mixed.model) and vars(today.data) == vars(mixed.data)
    assert train_settings(today) == train_settings(mixed)
    args.recipe = "fineweb-124m"
    fw, fw_mixed = config("today", args), config("with-mix", args)
    assert fw.data.recall_mix == 0 and fw.model.kv_keep_cost == 0     # fineweb as it is
    for key in TOOK:   # wt103-70m's values on fineweb's recipe
        section, name = key.split(".")
        assert getattr(getattr(fw_mixed, section), name) == getattr(getattr(today, section), name)
    assert fw_mixed.model.d_model == fw.model.d_model != today.model.d_model
    assert train_settings(fw) == train_settings(fw_mixed) and fw.train.chunk_len != today.train.chunk_len
    tf = config("transformer", args)   # fineweb's depth all attention, its tokens a step
    assert tf.model.layers == "A" * len(fw.model.layers) != "A" * len(today.model.layers)
    assert tf.train.chunk_len * tf.train.lanes == fw.train.lanes * fw.train.chunk_len * fw.model.bptt_chunks


def test_long_study_report_keeps_what_a_stopped_scorer_measured(tmp_path, capsys):
    # a scorer stopped by its call's timeout leaves the phases it finished, marked partial; the
    # report takes them and says how far each got
    import argparse

    from benchmarks.long_study import report, write_score
    args = argparse.Namespace(runs=str(tmp_path), kv_keep=0, smoke=True, hybrid="today",
                              out=str(tmp_path / "report.json"))
    for name in ("today", "keep"):
        (tmp_path / name).mkdir()
    test = {"nats_per_byte": 0.49}
    write_score(args, "today", {"train": {"steps": 5}, "test": test, "partial": "test"})
    write_score(args, "keep", {"train": {"steps": 5}, "test": {"nats_per_byte": 0.5},
                               "long": {"carried": {"bands": {}}},
                               "needle": {"needle_4k": 0.9}})
    assert not list(tmp_path.glob("*/*.tmp"))
    args.kv_keep = 128
    write_score(args, "keep", {"train": {"steps": 5}, "test": test, "partial": "long"})
    args.kv_keep = 0
    assert report(args) == 0
    out = json.loads((tmp_path / "report.json").read_text())
    assert out["partial"] == {"today": "test", "keep read with 128 kept": "long"}
    assert out["today_minus_keep_nats_per_byte"] == pytest.approx(-0.01)
    assert "needle_4k" not in out   # today's scorer stopped before its needle


def test_long_study_report_gives_the_associative_memory_its_keys(tmp_path):
    # issue 71's keys from a variant with kv_assoc: the memory's worth is its drop's loss increase
    # over 8K-32K, the memory alone the one-key needle with the kept tokens dropped
    import argparse

    from benchmarks.long_study import report, write_score
    args = argparse.Namespace(runs=str(tmp_path), kv_keep=0, smoke=True, hybrid="assoc",
                              out=str(tmp_path / "report.json"))
    (tmp_path / "assoc").mkdir()
    bands = {"8K-16K": 0.50, "16K-32K": 0.40}
    write_score(args, "assoc", {
        "train": {"steps": 5}, "test": {"nats_per_byte": 0.49},
        "long": {"carried": {"bands": bands},
                 "reset-2K": {"bands": {k: v + 0.03 for k, v in bands.items()}},
                 "drop-assoc": {"bands": {"8K-16K": 0.51, "16K-32K": 0.42}},
                 "drop-kept": {"bands": {k: v + 0.002 for k, v in bands.items()}}},
        "needle": {"needle_4k": 0.9},
        "needle_without_kept": {"needle_4k": 0.7, "needle_64k": 0.2, "needle_1k": 0.9}})
    assert report(args) == 0
    out = json.loads((tmp_path / "report.json").read_text())
    assert out["memory_worth_8k_32k"] == pytest.approx(0.015)
    assert out["part_worth_8k_32k"]["kept"] == pytest.approx(0.002)
    assert out["memory_alone_4k"] == 0.7 and out["memory_alone_64k"] == 0.2
    assert "memory_alone_1m" not in out and out["needle_4k"] == 0.9
