"""benchmarks/summarize.py clocks: nvidia-smi samples averaged over the spans a benchmark records."""
import json

from benchmarks import summarize


def test_samples_are_averaged_over_each_span_in_utc(tmp_path, capsys):
    csv = tmp_path / "clocks.csv"
    csv.write_text(
        "timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], temperature.gpu\n"
        "2026/11/26 11:00:00.000, 1000 MHz, 2619 MHz, 100.00 W, 30\n"
        "2026/11/26 11:00:00.500, 1800 MHz, 2619 MHz, 600.00 W, 50\n"
        "2026/11/26 11:00:01.000, 1900 MHz, 2619 MHz, 700.00 W, 60\n"
        "2026/11/26 11:00:02.000, 1500 MHz, 2619 MHz, 300.00 W, 40\n")
    t0 = 1795690800.0   # 2026-11-26 11:00:00 UTC
    spans = [{"path": "a", "round": 0, "start": t0 + 0.2, "end": t0 + 1.2},
             {"path": "b", "round": 0, "start": t0 + 1.5, "end": t0 + 1.9}]
    rows = summarize.by_span(summarize.read_samples(str(csv)), spans)
    assert rows[0]["samples"] == 2 and rows[0]["sm_mhz"] == 1850 and rows[0]["power_w"] == 650
    assert (rows[0]["sm_min"], rows[0]["sm_max"], rows[0]["temp_c"]) == (1800, 1900, 55)
    assert rows[1]["samples"] == 0 and "sm_mhz" not in rows[1]
    result = tmp_path / "r.json"
    result.write_text(json.dumps({"spans": spans}))
    assert summarize.main(["clocks", str(csv), str(result)]) == 0
    out = capsys.readouterr().out
    assert "1850 MHz (1800-1900)" in out and "no samples" in out


def test_utilization_column_and_train_speed_evaluation_passes(tmp_path, capsys):
    csv = tmp_path / "clocks.csv"
    csv.write_text("2026/11/26 11:00:00.500, 1800 MHz, 2619 MHz, 600.00 W, 50, 100 %\n"
                   "2026/11/26 11:00:01.000, 1900 MHz, 2619 MHz, 700.00 W, 60, 80 %\n"
                   "2026/11/26 11:00:02.500, 1500 MHz, 2619 MHz, 300.00 W, 40, 10 %\n")
    t0 = 1795690800.0
    result = tmp_path / "speed.json"
    turns = {"side": [{"tokens_per_s": 2e6, "span": [t0 + 0.2, t0 + 1.2]}],
             "graph": [{"tokens_per_s": 1.5e6, "span": [t0 + 2.0, t0 + 3.0]}]}
    result.write_text(json.dumps({"eval": {"modes_in_turns": turns}}))
    spans = summarize.eval_spans(json.loads(result.read_text()))
    assert [s["path"] for s in spans] == ["side 2,000k/s", "graph 1,500k/s"]
    rows = summarize.by_span(summarize.read_samples(str(csv)), spans)
    assert rows[0]["util"] == 90 and rows[1]["util"] == 10 and rows[1]["power_w"] == 300
    assert summarize.main(["clocks", str(csv), str(result)]) == 0
    assert "busy  90.0%" in capsys.readouterr().out


def test_result_files_name_the_commit_they_measured():
    import subprocess
    from pathlib import Path

    from benchmarks.common import environment
    env = environment("cpu")
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()
    assert env["device"] and env["torch"] and env["date"]
    if head:   # a git checkout (CI's clean clone is one)
        assert env["commit"].split("+")[0] == head


def test_a_copied_tree_names_the_commit_it_was_sent_at(monkeypatch):
    from benchmarks.common import environment
    monkeypatch.setenv("ELEPHANT_COMMIT", "176fe6a")
    assert environment("cpu")["commit"] == "176fe6a"
