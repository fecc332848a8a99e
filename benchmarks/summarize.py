"""What benchmarks/gpu.sh's stages logged, summed up (no GPU needed), one subcommand each:

    python benchmarks/summarize.py test-timeline TIMELINE.jsonl [--json OUT] [--seconds OUT]
    python benchmarks/summarize.py train-run RUN_DIR N_GPUS [RUN_DIR_1GPU]
    python benchmarks/summarize.py clocks CLOCKS.csv RESULT.json [RESULT.json ...]

test-timeline  where a parallel test run's wall time went (the `tests` stage), and each test's
               seconds for tests/gpu_seconds.json
train-run      a training run's log.jsonl as benchmarks/results/train_<gpu>_<n>gpu.json (the
               `train` and `train2` stages)
clocks         the GPU's clock, power and temperature over each span of a benchmark's results
               (the `packing-shapes` stage's nvidia-smi samples)
"""
from __future__ import annotations

import argparse
import csv
import inspect
import datetime
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# ----------------------------------------------------------------------------- test-timeline
def summarize_timeline(lines: list[dict]) -> dict:
    launch = min(r["at"] for r in lines if r["event"] in ("launch", "imported"))
    imported, started, tests = {}, {}, defaultdict(list)
    for r in lines:
        if r["event"] == "imported":
            imported[r["worker"]] = r["at"] - launch
            started[r["worker"]] = r.get("started", float("nan")) - launch
        elif r["event"] == "test":
            tests[r["worker"]].append((r["start"] - launch, r["stop"] - launch, r["test"]))
    workers = {}
    for w, runs in tests.items():
        runs.sort()
        workers[w] = dict(started_s=round(started.get(w, float("nan")), 1),
                          imported_s=round(imported.get(w, float("nan")), 1),
                          first_test_s=round(runs[0][0], 1), end_s=round(runs[-1][1], 1),
                          busy_s=round(sum(b - a for a, b, _ in runs), 1), tests=len(runs),
                          runs=[(round(a, 1), round(b - a, 1), t) for a, b, t in runs])
    last = max(workers, key=lambda w: workers[w]["end_s"])
    return dict(wall_s=workers[last]["end_s"], last_worker=last, workers=workers,
                main_imported_s=round(imported.get("main", float("nan")), 1),
                main_started_s=round(started.get("main", float("nan")), 1))


def seconds_by_test(summary: dict) -> dict:
    """{test id: seconds} of every test in the run."""
    return {test: secs for s in summary["workers"].values() for _, secs, test in s["runs"]}


def timeline(args) -> int:
    """Where a parallel test run's wall time went, from the timeline tests/conftest.py writes when
    ELEPHANT_TEST_TIMELINE names a file (benchmarks/gpu.sh's `tests` stage sets it and writes the
    launch time first): each worker's start (its process, its imports, its first test), its tests
    in order, and the worker that ended last, test by test."""
    with open(args.timeline) as f:
        summary = summarize_timeline([json.loads(line) for line in f if line.strip()])
    if args.seconds:
        with open(args.seconds, "w") as f:
            json.dump(seconds_by_test(summary), f, indent=0, sort_keys=True)
            f.write("\n")
    print(f"wall {summary['wall_s']} s from launch to the last test's end; the main process "
          f"started at {summary['main_started_s']} s (to the second), its conftest imported at "
          f"{summary['main_imported_s']} s")
    print(f"{'worker':>7} {'started':>8} {'imported':>9} {'first':>7} {'end':>7} {'busy':>7} tests")
    for w, s in sorted(summary["workers"].items(), key=lambda kv: kv[1]["end_s"]):
        print(f"{w:>7} {s['started_s']:8.1f} {s['imported_s']:9.1f} {s['first_test_s']:7.1f} "
              f"{s['end_s']:7.1f} {s['busy_s']:7.1f} {s['tests']}")
    last = summary["workers"][summary["last_worker"]]
    print(f"the last worker, {summary['last_worker']}, test by test (start, seconds):")
    for start, secs, test in last["runs"]:
        print(f"  {start:7.1f} {secs:6.1f}  {test}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


# --------------------------------------------------------------------------------- train-run
def summarize_run(run: Path) -> dict:
    from elephant.trainer import read_log
    records = [r for r in read_log(run / "log.jsonl") if r["kind"] == "train"][1:]
    evals = [r for r in read_log(run / "log.jsonl") if r["kind"] == "eval"]
    med = lambda key: statistics.median(r[key] for r in records if key in r) if records else None  # noqa: E731
    return {"steps": records[-1]["step"] if records else 0, "tokens_per_s": med("tokens_per_s"),
            "mfu": med("mfu"), "peak_mem_gb_per_gpu": max((r.get("peak_mem_gb", 0) for r in records), default=None),
            "final_train_loss": records[-1]["loss"] if records else None,
            "valid": {k: evals[-1][k] for k in ("loss", "bits_per_byte", "documents")} if evals else None}


def train_run(args) -> int:
    """A GPU training run's log.jsonl as benchmarks/results/train_<gpu>_<n>gpu.json: tokens/s, MFU
    and peak memory are the medians over the logged intervals after the first (compile and
    warm-up); with a 1-GPU run dir given, the speed-up of this run over it. SUMMARY_TAG=<tag> in
    the environment names another variant of the same run, beside it (train_<tag>_<gpu>_...)."""
    run, n = args.run_dir, args.gpus
    out = summarize_run(run)
    env = json.loads((run / "env.json").read_text())
    out.update(gpus=n, gpu=env.get("gpu"), torch=env.get("torch"), triton=env.get("triton"),
               date=datetime.datetime.now().isoformat(timespec="seconds"),
               command=(f"torchrun --standalone --nproc_per_node={n} " if n > 1 else "python ") +
               "train.py (benchmarks/gpu.sh TRAIN_ARGS) " + os.environ.get("TRAIN_EXTRA", ""),
               config=json.loads((run / "resolved_config.json").read_text()))
    if args.single:
        base = summarize_run(args.single)
        if base["tokens_per_s"] and out["tokens_per_s"]:
            out["speedup_vs_1gpu"] = out["tokens_per_s"] / base["tokens_per_s"]
            out["baseline_1gpu_tokens_per_s"] = base["tokens_per_s"]
    tag = (env.get("gpu") or "gpu").replace(" ", "_")
    if os.environ.get("SUMMARY_TAG"):   # another variant of the same run, beside it
        tag = f"{os.environ['SUMMARY_TAG']}_{tag}"
    path = Path(__file__).parent / "results" / f"train_{tag}_{n}gpu.json"
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "config"}))
    return 0


# ------------------------------------------------------------------------------------ clocks
def read_samples(path: str, utc_offset_h: float = 0.0) -> list[tuple]:
    """(unix seconds, SM MHz, power W, temperature C, GPU utilization % or None) of each sample
    row. The utilization is the share of the sample's period in which some kernel ran: well under
    100 while the GPU waits for its host."""
    tz = datetime.timezone(datetime.timedelta(hours=utc_offset_h))
    rows = []
    with open(path) as f:
        for r in csv.reader(f):
            if not r or r[0].startswith("timestamp"):
                continue
            t = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=tz)
            util = float(r[5].split()[0]) if len(r) > 5 else None
            rows.append((t.timestamp(), float(r[1].split()[0]), float(r[3].split()[0]),
                         float(r[4]), util))
    return rows


def by_span(samples: list, spans: list[dict], settle_s: float = 0.05) -> list[dict]:
    """Each span's samples averaged: path, round, seconds, samples, sm_mhz (mean, min, max),
    power_w, temp_c and util (means; util None without that column); no figures where no
    sample fell inside."""
    out = []
    for s in spans:
        inside = [x for x in samples if s["start"] + settle_s <= x[0] <= s["end"]]
        row = {"path": s["path"], "round": s["round"], "seconds": s["end"] - s["start"],
               "samples": len(inside)}
        if inside:
            n = len(inside)
            row.update(sm_mhz=sum(x[1] for x in inside) / n, sm_min=min(x[1] for x in inside),
                       sm_max=max(x[1] for x in inside), power_w=sum(x[2] for x in inside) / n,
                       temp_c=sum(x[3] for x in inside) / n,
                       util=None if inside[0][4] is None else sum(x[4] for x in inside) / n)
        out.append(row)
    return out


def eval_spans(result: dict) -> list[dict]:
    """train_speed.py --eval-modes: each timed pass as a span (path: its mode and tokens/s),
    in the order they ran."""
    turns = (result.get("eval") or {}).get("modes_in_turns") or {}
    spans = [{"path": f"{mode} {run['tokens_per_s'] / 1e3:,.0f}k/s", "round": i,
              "start": run["span"][0], "end": run["span"][1]}
             for mode, runs in turns.items() for i, run in enumerate(runs) if run.get("span")]
    return sorted(spans, key=lambda s: s["start"])


def clocks(args) -> int:
    """The GPU's SM clock, power and temperature while each path of a benchmark ran: nvidia-smi's
    samples (a CSV, as `gpu.sh packing-shapes` writes with --query-gpu=timestamp,clocks.sm,
    clocks.mem,power.draw,temperature.gpu, and optionally utilization.gpu after them) averaged over
    each `spans` entry of result JSONs (bench_packing.py records when each path's round ran, Unix
    seconds), or over each evaluation pass of train_speed.py --eval-modes (its `span`).

        python benchmarks/summarize.py clocks CLOCKS.csv RESULT.json [RESULT.json ...]

    nvidia-smi writes its timestamps in the machine's local time, which is UTC on the device machines
    (--utc-offset-h otherwise). Samples are instants every ~200 ms; a round under a second holds only
    a few, so a path's figure is an indication, and a power-capped GPU's clock swings within a round."""
    samples = read_samples(args.clocks, args.utc_offset_h)
    for path in args.results:
        result = json.load(open(path))
        spans = result.get("spans") or eval_spans(result)
        if not spans:
            print(f"{path}: no spans", file=sys.stderr)
            continue
        print(path)
        for r in by_span(samples, spans):
            if r["samples"]:
                print(f"  {r['path']:<24} round {r['round']} {r['seconds']:6.2f} s {r['samples']:4d} "
                      f"samples  SM {r['sm_mhz']:5.0f} MHz ({r['sm_min']:.0f}-{r['sm_max']:.0f})  "
                      f"{r['power_w']:4.0f} W  {r['temp_c']:.0f} C"
                      + ("" if r["util"] is None else f"  busy {r['util']:5.1f}%"))
            else:
                print(f"  {r['path']:<24} round {r['round']} {r['seconds']:6.2f} s  no samples")
    return 0



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="NAME")
    sp = sub.add_parser("test-timeline", help="where a parallel test run's wall time went",
                        description=inspect.cleandoc(timeline.__doc__))
    sp.add_argument("timeline")
    sp.add_argument("--json", help="write the summary here too")
    sp.add_argument("--seconds", help="write each test's seconds here (tests/gpu_seconds.json: "
                                      "tests/conftest.py runs the quickest after each long one)")
    sp.set_defaults(run=timeline)
    sp = sub.add_parser("train-run", help="a training run's log as a results file",
                        description=inspect.cleandoc(train_run.__doc__))
    sp.add_argument("run_dir", type=Path)
    sp.add_argument("gpus", type=int)
    sp.add_argument("single", type=Path, nargs="?", help="the same run on 1 GPU (for the speed-up)")
    sp.set_defaults(run=train_run)
    sp = sub.add_parser("clocks", help="nvidia-smi samples averaged over a benchmark's spans",
                        description=inspect.cleandoc(clocks.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("clocks")
    sp.add_argument("results", nargs="+")
    sp.add_argument("--utc-offset-h", type=float, default=0.0)
    sp.set_defaults(run=clocks)
    args = ap.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
