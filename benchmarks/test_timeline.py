"""Where a parallel test run's wall time went, from the timeline tests/conftest.py writes when
ELEPHANT_TEST_TIMELINE names a file (benchmarks/gpu.sh's `tests` stage sets it and writes the
launch time first): each worker's start (its process, its imports, its first test), its tests in
order, and the worker that ended last, test by test. `python benchmarks/test_timeline.py timeline.jsonl [--json out.json]`"""
import argparse
import json
from collections import defaultdict


def summarize(lines: list[dict]) -> dict:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("timeline")
    ap.add_argument("--json", help="write the summary here too")
    ap.add_argument("--seconds", help="write each test's seconds here (tests/gpu_seconds.json: "
                                      "tests/conftest.py runs the quickest after each long one)")
    args = ap.parse_args()
    with open(args.timeline) as f:
        summary = summarize([json.loads(line) for line in f if line.strip()])
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


if __name__ == "__main__":
    main()
