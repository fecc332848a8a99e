"""benchmarks/eval_speed.py on the CPU: eval.py timed as a whole command at tiny shapes (a random
model of the wt103-70m recipe's kind, bytes as tokens, the stdlib's text), cold and warm, and a
warm run's breakdown by phase. Its figures must be eval.py's own: the tokens it reported, one
document for the long-document case, the breakdown's counted tokens and loss those of a plain run;
eval.py's JSON carries the pass's peak CUDA memory, null on the CPU."""
import json
import math
from pathlib import Path

import pytest

from benchmarks import eval_speed

CASES = ("64_lanes", "1m_doc")
MODEL = "wt103-70m"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run of 4 eval.py processes (~6 s each here, imports mostly): the recipe's own
    kv_keep (the kv_keep=0 model adds warm runs of the same code), the 64-lane case cold then
    warm, its breakdown and 2 of its steady chunks profiled, the long document warm."""
    root = tmp_path_factory.mktemp("eval-speed")
    out = root / "eval_speed.json"
    code = eval_speed.main(["--cpu-smoke", "--kv-keep", "recipe", "--cases", ",".join(CASES),
                            "--cold", "64_lanes", "--breakdown", "64_lanes", "--profile", "2",
                            "--work", str(root / "work"), "--out", str(out)])
    return code, json.loads(out.read_text()), root / "work"


def test_smoke_writes_the_goals_keys_and_every_run(smoke):
    code, r, _ = smoke
    assert code == 0 and r["failures"] == []
    for key in ("device", "date", "commit", "command", "torch", "goals", "sizes", "models"):
        assert key in r, key
    assert r["smoke"] is True and r["headline_recipe"] == MODEL
    runs = r["cases"]["64_lanes"][MODEL]
    assert set(runs) == {"cold", "warm", "breakdown", "profile", "cold_extra_s"}, runs.keys()
    assert runs["cold"]["cold"] and not runs["warm"]["cold"]
    assert runs["cold_extra_s"] == runs["cold"]["wall_s"] - runs["warm"]["wall_s"]
    assert set(r["cases"]["1m_doc"][MODEL]) == {"warm"}
    assert r["eval_tok_s_64_lanes"] == r["cases"]["64_lanes"][MODEL]["warm"]["tok_s"] > 0
    assert r["eval_tok_s_1m_doc"] == r["cases"]["1m_doc"][MODEL]["warm"]["tok_s"] > 0
    assert r["eval_tok_s_64_lanes_kv_keep_0"] is None   # not asked for here
    assert r["models"][MODEL]["kv_keep"] > 0


def test_the_profile_run_times_steady_chunks_by_kernel_kind_and_host_operator(smoke):
    _, r, _ = smoke
    p = r["cases"]["64_lanes"][MODEL]["profile"]["profile"]
    assert p["chunks"] == 2 and p["wall_ms_per_chunk"] > 0
    by_kind = p["summary"]["by_kind"]   # on the CPU: the operators' own time, by kind
    assert by_kind and sum(by_kind.values()) == pytest.approx(p["summary"]["device_ms_per_step"])
    assert "aten::mm" in p["table_host"] and "Self CPU" in p["table_host"]


def test_the_recall_recipes_bytes_per_second_is_the_kept_read_goals_key():
    # --recipes recall (4,096 kept tokens at inference): its warm 64-lane bytes/s is
    # kept4096_bytes_s, with its goal; without that model, neither
    runs = {"64_lanes": {"recall": {"warm": {"bytes_s": 1.2e6, "tok_s": 1.2e6}}}}
    out = eval_speed.headline(runs, "recall", None)
    assert out["kept4096_bytes_s"] == 1.2e6 and out["meets_goals"]["kept4096_bytes_s"]
    out = eval_speed.headline({"64_lanes": {MODEL: {"warm": {"tok_s": 1.0}}}}, MODEL, None)
    assert out["kept4096_bytes_s"] is None and "kept4096_bytes_s" not in out["meets_goals"]


def test_tokens_and_speed_are_eval_pys_own(smoke):
    _, r, _ = smoke
    for case, kind in (("64_lanes", "cold"), ("64_lanes", "warm"), ("1m_doc", "warm")):
        run = r["cases"][case][MODEL][kind]
        ours = json.loads(Path(run["json"]).read_text())["elephant"]
        assert run["tokens"] == ours["tokens"] > 0
        assert run["documents"] == ours["documents"]
        assert run["tok_s"] == pytest.approx(ours["tokens"] / run["wall_s"], rel=1e-12)
        # the field eval.py reports for the benchmark: present, and null without CUDA
        assert "peak_mem_gb" in ours and ours["peak_mem_gb"] is None
        assert run["peak_mem_gb"] is None
    cold, warm = r["cases"]["64_lanes"][MODEL]["cold"], r["cases"]["64_lanes"][MODEL]["warm"]
    assert cold["loss"] == warm["loss"] and cold["tokens"] == warm["tokens"]
    # the cold run tokenized the text (its corpus: a token more a document than predicted)
    corpus = cold["corpus"]
    assert corpus["tokenize_s"] > 0 and "corpus" not in warm
    assert corpus["tokens"] - corpus["documents"] == cold["tokens"]


def test_the_long_document_case_is_one_document_of_many_chunks(smoke):
    _, r, work = smoke
    run = r["cases"]["1m_doc"][MODEL]["warm"]
    sizes, chunk = r["sizes"], r["models"][MODEL]["chunk_len"]
    files = list((work / "text" / "bytes" / "1m_doc").rglob("*.txt"))
    assert len(files) == 1
    assert run["documents"] == 1 and run["lanes"] == 1
    assert run["tokens"] >= sizes["doc_tokens"]
    # one lane: a chunk a step, as many as the document's tokens need, more than a handful
    assert run["chunk_steps"] == run["lane_chunks"] == math.ceil(run["tokens"] / chunk)
    assert run["chunk_steps"] >= sizes["doc_tokens"] // chunk >= 15
    many = r["cases"]["64_lanes"][MODEL]["warm"]
    assert many["lanes"] == sizes["lanes"] and many["documents"] > sizes["lanes"]
    assert many["tokens"] >= sizes["corpus_tokens"]


def test_the_breakdown_counts_a_plain_runs_tokens_and_accounts_for_its_wall(smoke):
    _, r, _ = smoke
    b = r["cases"]["64_lanes"][MODEL]["breakdown"]
    warm = r["cases"]["64_lanes"][MODEL]["warm"]
    lanes, chunk = r["sizes"]["lanes"], r["models"][MODEL]["chunk_len"]
    # eval.py's own main ran: the same tokens and loss as the plain warm run
    assert b["tokens"] == warm["tokens"] and b["loss"] == warm["loss"]
    # the probe inside evaluate() saw every token once: the first chunks' (every lane full)
    # and the rest's
    assert b["counted_tokens"] == b["tokens"]
    assert b["tokens_first"] == eval_speed.FIRST_CHUNKS * lanes * chunk
    phases = b["phases"]
    for key in ("a_import_torch_s", "a_import_project_s", "a_model_load_s", "b_data_s",
                "c_first_chunks_s", "d_steady_s", "e_report_s", "e_exit_s"):
        assert phases[key] > 0, key
    # what no timer covers is the patching between the imports and main: under 0.1 s
    assert abs(phases["unaccounted_s"]) < 0.1
    assert b["steady_tok_s"] == pytest.approx(b["tokens_steady"] / phases["d_steady_s"])
    assert b["goal_wall_s"] == pytest.approx(b["tokens"] / eval_speed.GOALS["eval_tok_s_64_lanes"])


def test_run_plan_runs_the_first_model_cold_then_warm_and_others_warm():
    assert eval_speed.run_plan(list(eval_speed.CASES), first=True) == [
        ("short_doc", "cold"), ("64_lanes", "cold"), ("1m_doc", "cold"),
        ("64_lanes", "warm"), ("1m_doc", "warm"), ("short_doc", "warm")]
    assert eval_speed.run_plan(list(eval_speed.CASES), first=False) == [
        ("64_lanes", "warm"), ("1m_doc", "warm")]
    assert eval_speed.run_plan(["1m_doc"], first=True) == [("1m_doc", "cold"), ("1m_doc", "warm")]
    assert eval_speed.run_plan(["64_lanes", "1m_doc"], first=True, cold=["64_lanes"]) == [
        ("64_lanes", "cold"), ("64_lanes", "warm"), ("1m_doc", "warm")]
    names = [n for n, _, _ in eval_speed.variants(["wt103-70m"], ["recipe", "0"])]
    assert names == ["wt103-70m", "wt103-70m kv_keep=0"]
