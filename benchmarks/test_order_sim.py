"""The GPU suite's (or with --cpu the CPU suite's) order under pytest-xdist's worksteal, simulated
over measured seconds: when the
suite would end in the collected order and in tests/conftest.py's order by seconds, each test's
time drawn again within +-`--jitter` over `--trials` runs (a machine's spread). The tests, their
order and their heavy marks are collected here (on the CPU too); the seconds are a run's
(`tests/gpu_seconds.json`, or one written by `benchmarks/test_timeline.py --seconds`).

    python benchmarks/test_order_sim.py tests/gpu_seconds.json [--workers 16]
    python benchmarks/test_order_sim.py tests/cpu_seconds.json --cpu --workers 2

The model: worksteal's first shares (len(pending) // idle workers, worker by worker); each worker
runs its queue in order; a worker holding fewer than two tests is idle and takes the back half of
the longest queue, leaving that queue's owner two. Start-up is not modelled: times are from the
first test."""
import argparse
import heapq
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def collect(marker: str = "gpu") -> tuple[list[str], set[str]]:
    """The ids of the tests `marker` selects (pytest -m) in collected order, and those marked heavy."""
    import pytest

    class Collector:
        items: list = []

        def pytest_collection_finish(self, session):
            self.items = list(session.items)

    c = Collector()
    pytest.main(["--collect-only", "-q", "-m", marker, "-p", "no:cacheprovider", str(ROOT / "tests")],
                plugins=[c])
    return [i.nodeid for i in c.items], {i.nodeid for i in c.items if "heavy" in i.keywords}


def simulate(order: list, seconds: dict, workers: int, min_pending: int = 2) -> float:
    """When the last test ends, `order` dealt and stolen as worksteal does."""
    queues = [[] for _ in range(workers)]
    pending = list(order)

    def deal(idle):
        for i, w in enumerate(idle):
            k = len(pending) // (len(idle) - i)
            queues[w] += pending[:k]
            del pending[:k]
    deal(range(workers))
    events = [(seconds[q[0]], w) for w, q in enumerate(queues) if q]
    heapq.heapify(events)
    end = 0.0
    while events:
        now, w = heapq.heappop(events)
        end = now
        queues[w].pop(0)
        idle = [x for x in range(workers) if len(queues[x]) < min_pending]
        if idle:
            src = max(range(workers), key=lambda x: len(queues[x]))
            n = min(len(queues[src]) // 2, max(0, len(queues[src]) - min_pending))
            if n:
                pending += queues[src][-n:]
                del queues[src][-n:]
                deal([x for x in range(workers) if len(queues[x]) < min_pending])
        running = {x for _, x in events}
        for x in range(workers):
            if queues[x] and x not in running:
                heapq.heappush(events, (now + seconds[queues[x][0]], x))
    return end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("seconds", help="{test id: seconds} (tests/gpu_seconds.json)")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--jitter", type=float, default=0.3)
    ap.add_argument("--cpu", action="store_true", help="the CPU suite (the tests not marked gpu)")
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]   # the tests import both, as under pytest
    from conftest import spread_heavy
    measured = json.loads(Path(args.seconds).read_text())
    items, heavy = collect("not gpu" if args.cpu else "gpu")
    missing = [t for t in items if t not in measured]
    if missing:
        sys.exit(f"{len(missing)} collected tests have no seconds in {args.seconds}, e.g. {missing[0]}")
    orders = {"collected": spread_heavy(items, args.workers, heavy.__contains__),
              "by seconds": spread_heavy(items, args.workers, heavy.__contains__, measured.get)}
    rng = random.Random(0)
    excess = {name: [] for name in orders}
    for _ in range(args.trials):
        drawn = {t: s * rng.uniform(1 - args.jitter, 1 + args.jitter) for t, s in measured.items()}
        for name, order in orders.items():
            excess[name].append(simulate(order, drawn, args.workers) - max(drawn[t] for t in items))
    print(f"{len(items)} tests ({len(heavy)} heavy), {sum(measured[t] for t in items):.0f} s of work, "
          f"{args.workers} workers; the longest test {max(measured[t] for t in items):.1f} s")
    for name, order in orders.items():
        e = sorted(excess[name])
        print(f"{name:>11}: ends {simulate(order, measured, args.workers):6.1f} s at the measured seconds; "
              f"after the longest test by {e[len(e) // 2]:.1f} s (median), {e[int(len(e) * 0.9)]:.1f} s (p90) "
              f"with +-{args.jitter:.0%}")


if __name__ == "__main__":
    main()
