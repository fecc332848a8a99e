"""The speed benchmark's parts on the CPU: the plain GPT yardstick (causal, sized as asked, FLOPs
counted like ours, imports nothing of elephant) and benchmarks/train_speed.py end to end at tiny
shapes (its result file and the checks that make it fail)."""
import ast
import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import baseline_gpt, train_speed
from benchmarks.baseline_gpt import GPT, GPTConfig, matched_config

ROOT = Path(__file__).resolve().parents[1]


def tiny_gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, d_mlp=64), **kw}))


def test_baseline_gpt_imports_nothing_of_elephant():
    tree = ast.parse((ROOT / "benchmarks/baseline_gpt.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert names and not [n for n in names if n.startswith(("elephant", "data_packing", "benchmarks"))]


def test_baseline_gpt_is_causal_and_starts_near_uniform():
    model = tiny_gpt()
    tokens = torch.randint(0, 61, (2, 17))
    targets = torch.randint(0, 61, (2, 16))
    loss = model(tokens[:, :-1], targets)
    assert abs(loss.item() - math.log(61)) < 0.3
    # a change at position 10 leaves every earlier position's prediction as it was
    hidden = []
    for t in (tokens, torch.cat([tokens[:, :10], (tokens[:, 10:] + 1) % 61], 1)):
        x = model.embed(t[:, :-1])
        cos, sin = baseline_gpt.rotary_tables(16, 8, 10000.0, "cpu")
        for block in model.blocks:
            x = block(x, cos, sin)
        hidden.append(x)
    assert torch.equal(hidden[0][:, :10], hidden[1][:, :10])
    assert not torch.equal(hidden[0][:, 10:], hidden[1][:, 10:])


def test_matched_config_matches_the_parameter_count():
    for target in (62_356_216, 59_319_808):
        cfg = matched_config(target)
        assert cfg.d_mlp % 128 == 0
        assert abs(GPT(cfg).num_params() - target) <= 8 * 2 * 512 * 64   # within half a width step
    with pytest.raises(ValueError, match="heads"):
        GPTConfig(d_model=100, n_heads=8).validate()


def test_baseline_flops_count_every_matrix_once_and_attention():
    model = tiny_gpt()
    matmul = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert matmul == 61 * 32 + 2 * (4 * 32 * 32 + 2 * 32 * 64)          # the tied head once
    assert model.flops_per_token(16) == 6 * matmul + 2 * 6 * 2 * 32 * 17 / 2


def test_baseline_cli_smoke(capsys):
    assert baseline_gpt.main(["--cpu-smoke"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens_per_s"] > 0 and result["mfu"] is None and math.isfinite(result["last_loss"])


def test_train_speed_smoke_writes_its_result(tmp_path):
    out = tmp_path / "speed.json"
    code = train_speed.main(["--cpu-smoke", "--only", "baseline,attention", "--warmup", "0",
                             "--steps", "1", "--profile-steps", "1", "--cache",
                             str(tmp_path / "cache"), "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["failures"] == []
    for key in ("device", "torch", "date", "command", "ratio_attention"):
        assert key in result, key
    for part in ("baseline", "attention"):
        run = result["runs"][part]
        assert run["tokens_per_s"] > 0 and run["tokens_per_step"] == 4 * 64 * 2
        assert run["top_kernels"] and run["dynamo"]["graph_breaks"] == 0
        summary = run["profile_summary"]
        assert summary["kernels"] and summary["device_ms_per_step"] > 0
        assert sum(summary["by_kind"].values()) == pytest.approx(
            sum(k["ms_per_step"] for k in summary["kernels"]), rel=0.05)   # tiny ones left out
    # our step's phases, timed by the profile's ranges (on the CPU: host time)
    ranges = result["runs"]["attention"]["profile_summary"]["ranges"]
    assert ranges["phase:optimizer"] > 0 and ranges["phase:windows"] > ranges["phase:optimizer"]
    assert result["runs"]["attention"]["config"]["model"]["layers"] == "AAAA"
    assert 0 < result["runs"]["attention"]["fill"] <= 1
    assert (tmp_path / "speed_profile.txt").read_text().startswith("== baseline GPT")


def test_kernel_kinds():
    from benchmarks.common import kernel_kind
    names = {   # kernel names as the H100 profiles show them, and their kind
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma": "attention",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, "
        "false, cutlass::bfloat16_t>": "attention",
        "_chunk_scan_bwd_kernel": "ssd scan",
        "_states_bwd_kernel": "ssd scan",
        "_state_pass_bwd_kernel": "ssd scan",   # (the kernel before 2026-11-25, in older profiles)
        "_conv_fwd_kernel": "conv",
        "_bwd_kernel": "elephant activation",
        "_glu_cat_bwd_kernel": "elephant activation",   # its "cat_" is not a copy
        "_gated_norm_bwd_kernel": "norm",
        "triton_red_fused__to_copy_arange_eq_exp_gather_logsumexp_mul": "loss",
        "_ce_kernel": "loss",
        "triton_per_fused__fused_rms_norm_backward__to_copy_add_view_16": "norm",
        "_qkv_bwd_kernel": "norm",
        "void at::native::reduce_kernel<128, 4>": "reduction",
        "Memcpy DtoD (Device -> Device)": "copy",
        "triton_poi_fused_silu_9": "fused elementwise (inductor)",
        "Memset (Device)": "other",
    }
    for name, kind in names.items():
        assert kernel_kind(name) == kind, name


def test_train_speed_fails_on_graph_breaks_and_recompiles():
    warm = {"graph_breaks": 0, "graph_break_reasons": [], "frames_compiled": 4, "graphs": 4}
    assert train_speed.compile_failures("x", warm, warm, compiled=True) == []
    broke = dict(warm, graph_breaks=2, graph_break_reasons=["data-dependent branch"])
    assert "graph break" in train_speed.compile_failures("x", warm, broke, compiled=True)[0]
    again = dict(warm, frames_compiled=5)
    assert "recompiles" in train_speed.compile_failures("x", warm, again, compiled=True)[0]
    assert train_speed.compile_failures("x", warm, again, compiled=False) == []


def test_train_speed_rejects_bad_arguments(capsys):
    for argv in (["--only", "nothing"], ["--only", "eval"], ["--steps", "0"],
                 ["--only", "hybrid,eval", "--eval-profile-tokens", "1000"]):
        with pytest.raises(SystemExit):
            train_speed.parse(argv)
        assert "error" in capsys.readouterr().err


def test_device_gaps_measure_the_idle_time_between_kernels():
    # (start, end, name) in us over 2 steps: overlapping kernels count once, and each gap is sized,
    # bucketed and named by the kernels around it
    from benchmarks.common import device_gaps
    kernels = [(0, 10, "a"), (5, 12, "b"), (14, 20, "c"), (80, 90, "d"), (700, 710, "e"),
               (702, 705, "f")]
    gaps = device_gaps(kernels, steps=2, top=2)
    assert gaps["idle_ms_per_step"] == (2 + 60 + 610) / 1e3 / 2
    assert gaps["by_size"]["<5us"] == {"ms_per_step": 2 / 1e3 / 2, "per_step": 0.5}
    assert gaps["by_size"]["50-500us"]["per_step"] == 0.5
    assert gaps["by_size"][">500us"]["ms_per_step"] == 610 / 1e3 / 2
    assert gaps["largest"] == [{"us": 610, "after": "d", "before": "e"},
                               {"us": 60, "after": "c", "before": "d"}]
    assert device_gaps([], steps=1)["idle_ms_per_step"] == 0.0


def test_train_speed_under_torchrun_counts_every_rank(tmp_path, monkeypatch):
    # two gloo processes time the same steps as one process: tokens per step and tokens/s of every
    # rank, MFU per GPU, only rank 0 writes, and --single gives the speed-up over the one-process run
    import os
    import subprocess
    import sys
    common = ["--cpu-smoke", "--only", "attention", "--warmup", "0", "--steps", "1",
              "--profile-steps", "1", "--cache", str(tmp_path / "cache")]
    single = tmp_path / "one.json"
    assert train_speed.main([*common, "--out", str(single)]) == 0
    two = tmp_path / "two.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", str(ROOT / "benchmarks/train_speed.py"), *common,
                          "--out", str(two), "--single", str(single)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count('"speedup"') == 1            # one summary: rank 0's
    result = json.loads(two.read_text())
    attention = result["runs"]["attention"]
    assert attention["gpus"] == 2 and attention["tokens_per_step"] == 2 * 4 * 64 * 2
    assert attention["tokens_per_s"] > 0 and 0 < attention["fill"] <= 1
    one = json.loads(single.read_text())["runs"]["attention"]
    assert one["gpus"] == 1 and one["tokens_per_step"] == 4 * 64 * 2
    assert result["speedup"]["attention"] == pytest.approx(attention["tokens_per_s"] / one["tokens_per_s"])
    # the yardstick and evaluation run in one process
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        train_speed.parse(["--only", "baseline,hybrid"])


def test_sync_count_ignores_the_debug_modes_notice():
    # what torch warns in CUDA's sync debug mode: once that the mode is a prototype, then at each
    # synchronizing call; only the latter is a sync
    assert train_speed.is_sync_warning("called a synchronizing CUDA operation")
    assert not train_speed.is_sync_warning(
        "Synchronization debug mode is a prototype feature and does not yet detect all "
        "synchronizing operations")


def test_inductor_options_are_parsed_as_literals_and_reach_the_models_compile(monkeypatch):
    # --inductor OPTION=VALUE (train_speed.py, bench_packing.py): Python literals, a malformed one
    # refused by name, and the options added to those ElephantLM.compile_for passes to inductor
    import elephant.model
    from benchmarks.common import inductor_options, use_inductor_options
    errors = []
    got = inductor_options(["combo_kernels=True", " max_autotune = 0", "mode='x=y'"], errors.append)
    assert got == {"combo_kernels": True, "max_autotune": 0, "mode": "x=y"} and not errors
    for bad in ("combo_kernels", "=1", "combo_kernels=yes please"):
        inductor_options([bad], errors.append)
    assert len(errors) == 3 and all("--inductor" in e for e in errors) and repr("=1") in errors[1]
    monkeypatch.setattr(elephant.model, "INDUCTOR_OPTIONS", dict(elephant.model.INDUCTOR_OPTIONS))
    use_inductor_options({"combo_kernels": True})
    kw = elephant.model.compile_kwargs("inductor")
    assert kw["options"]["combo_kernels"] is True and kw["options"]["comprehensive_padding"] is False
    assert train_speed.parse(["--inductor", "combo_kernels=True"]).inductor_options == {"combo_kernels": True}
    with pytest.raises(SystemExit):
        train_speed.parse(["--inductor", "combo_kernels"])


def test_eval_timing_reports_rows_and_the_full_lane_rate_only_when_lanes_are_kept():
    # a pass over one long document and a few short ones: the rows computed a second (padding
    # included) are the tokens a second over the lane fill; "at full lanes" only when the batch
    # kept every lane (the compacted pass ends on one lane, fewer rows for the same tokens)
    import numpy as np
    from data_packing import TokenizedCorpus
    from tiny_lm import tiny_lm
    gen = np.random.default_rng(0)
    corpus = TokenizedCorpus.from_documents([gen.integers(0, 97, n) for n in (400, 30, 20, 25, 16)])
    model = tiny_lm().float()
    res = {compact: train_speed.time_eval(model, corpus, lanes=8, chunk_len=16, device="cpu",
                                          autocast=None, compact=compact)
           for compact in (False, True)}
    for compact, r in res.items():
        assert r["tokens"] == 491 - 5 and 0 < r["lane_fill"] < 1     # each document: n - 1 targets
        assert r["row_tokens_per_s"] == pytest.approx(r["tokens_per_s"] / r["lane_fill"])
        assert r["row_tokens_per_s"] == pytest.approx(r["lane_chunks"] * 16 / r["seconds"])
        assert r["tokens_per_s_at_full_lanes"] == (None if compact else r["row_tokens_per_s"])
    assert res[True]["lane_chunks"] < res[False]["lane_chunks"]
    assert res[True]["loss"] == pytest.approx(res[False]["loss"], rel=1e-6)
    # the long document read by a side batch (one lane of the eight) beside the other seven
    side = train_speed.time_eval(model, corpus, lanes=8, chunk_len=16, device="cpu", autocast=None,
                                 compact=True, side=True)
    assert side["side"] and side["side_documents"] == 1 and side["tokens"] == 491 - 5
    assert side["loss"] == pytest.approx(res[False]["loss"], rel=1e-6)
    assert res[False]["side_documents"] == 0


def test_eval_modes_are_timed_in_turns_and_agree():
    # --eval-modes: one untimed pass of each mode, then --eval-rounds rounds of all of them in
    # turns over the same documents; each mode's median tokens/s, and the same loss every way
    # (float64 on the CPU); the side mode reads the long document beside the batch
    import numpy as np
    from data_packing import TokenizedCorpus
    from elephant.config import ModelConfig
    from elephant.model import ElephantLM
    torch.manual_seed(0)
    model = ElephantLM(ModelConfig(vocab_size=61, d_model=32, n_heads=4, layers="MAMA", d_mlp=48,
                                   d_state=16, mamba_head_dim=16, ssd_chunk=8, n_mem=2,
                                   kv_window=16)).double()
    rng = np.random.default_rng(0)
    corpus = TokenizedCorpus.from_documents([rng.integers(0, 61, n) for n in [300] + [20] * 30])
    args = train_speed.parse(["--cpu-smoke", "--only", "hybrid,eval", "--eval-modes",
                              "plain,compact,side", "--eval-rounds", "2", "--eval-tokens", "10000"])
    out = train_speed.eval_in_turns(args, model, corpus, 8, "cpu", None, lanes=8)
    turns = out["modes_in_turns"]
    assert list(turns) == ["plain", "compact", "side"] and all(len(r) == 2 for r in turns.values())
    assert [r["side_documents"] for r in turns["side"]] == [1, 1]
    assert turns["compact"][0]["lane_chunks"] < turns["plain"][0]["lane_chunks"]
    for mode in turns:
        assert out[f"eval_{mode}_tokens_per_s"] > 0 and out[f"eval_{mode}_loss_diff"] < 1e-12
    with pytest.raises(SystemExit):
        train_speed.parse(["--cpu-smoke", "--eval-modes", "plain,fast"])
