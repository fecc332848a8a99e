"""The GPU suite's order under pytest-xdist (tests/conftest.py's spread_heavy): worksteal hands each
worker a contiguous share of the collected tests, so the long compiles must head different shares
to start together."""
import pytest
from conftest import spread_heavy


def worksteal_shares(order: list, workers: int) -> list[list]:
    """The shares pytest-xdist's worksteal deals at the start: len(pending) // idle workers left."""
    pending, shares = list(order), []
    for w in range(workers):
        size = len(pending) // (workers - w)
        shares.append(pending[:size])
        del pending[:size]
    return shares


@pytest.mark.parametrize("n, heavy_at, workers", [
    (84, [40, 41, 42, 60, 61, 62, 63, 70], 16),   # the GPU suite's shape: 8 long tests, 16 workers
    (84, [40, 41, 42, 60, 61, 62, 63, 70], 3),    # more long tests than workers
    (5, [0, 1, 2, 3, 4], 8),                      # fewer tests than workers: empty shares
    (30, [], 4),
])
def test_long_tests_head_the_shares_in_turn(n, heavy_at, workers):
    items = [f"h{i}" if i in heavy_at else f"t{i}" for i in range(n)]
    order = spread_heavy(items, workers, lambda item: item.startswith("h"))
    assert sorted(order) == sorted(items)                         # a reordering, nothing lost
    shares = worksteal_shares(order, workers)
    counts = [sum(item.startswith("h") for item in share) for share in shares]
    # spread as evenly as the shares allow, each share's long tests first
    assert max(counts) - min(counts) <= 1
    for share, count in zip(shares, counts):
        assert all(item.startswith("h") for item in share[:count])
    # the others keep their collected order
    assert [i for i in order if i.startswith("t")] == [i for i in items if i.startswith("t")]


def test_timeline_summary_names_the_worker_that_ended_last():
    # `benchmarks/summarize.py test-timeline` on a timeline as tests/conftest.py writes it: times
    # from launch
    from benchmarks.summarize import seconds_by_test, summarize_timeline
    t0 = 1000.0
    lines = [dict(event="launch", at=t0),
             dict(event="imported", worker="gw0", at=t0 + 9), dict(event="imported", worker="gw1", at=t0 + 11),
             dict(event="test", worker="gw1", test="b", start=t0 + 12, stop=t0 + 90),
             dict(event="test", worker="gw0", test="a2", start=t0 + 40, stop=t0 + 50),
             dict(event="test", worker="gw0", test="a1", start=t0 + 10, stop=t0 + 40),
             dict(event="test", worker="gw1", test="c", start=t0 + 90, stop=t0 + 101)]
    s = summarize_timeline(lines)
    assert s["wall_s"] == 101 and s["last_worker"] == "gw1"
    assert s["workers"]["gw0"]["runs"] == [(10, 30, "a1"), (40, 10, "a2")]   # in start order
    assert (s["workers"]["gw1"]["imported_s"], s["workers"]["gw1"]["busy_s"]) == (11, 89)
    assert seconds_by_test(s) == {"a1": 30, "a2": 10, "b": 78, "c": 11}   # gpu_seconds.json's form


def test_the_test_after_each_long_one_is_the_quickest_measured():
    # worksteal never steals the test a worker runs next, so the one after each long test is the
    # quickest of the last run's (tests/gpu_seconds.json); unmeasured tests are never picked
    items = [f"h{i}" for i in range(3)] + [f"t{i}" for i in range(30)]
    secs = {f"t{i}": 30 - i for i in range(20)}            # t19 the quickest; t20.. unmeasured
    order = spread_heavy(items, 4, lambda item: item.startswith("h"), secs.get)
    assert sorted(order) == sorted(items)
    shares = worksteal_shares(order, 4)
    assert [share[:2] for share in shares[:3]] == [["h0", "t19"], ["h1", "t18"], ["h2", "t17"]]
    assert not shares[3][0].startswith("h")
    # the others longest first (unmeasured as the longest) where no heavy test runs: share 3
    assert shares[3][0] in {"t0"} | {f"t{i}" for i in range(20, 30)}
    for share in shares:
        rest = [secs.get(t, 30) for t in share if t.startswith("t")][1 if share[0][0] == "h" else 0:]
        assert rest == sorted(rest, reverse=True), share
    # the quickest first in the collected order: taken out before the shares are filled
    secs = {f"t{i}": i for i in range(30)}
    shares = worksteal_shares(spread_heavy(items, 4, lambda item: item.startswith("h"), secs.get), 4)
    assert sorted(sum(shares, [])) == sorted(items)
    assert [share[:2] for share in shares[:3]] == [["h0", "t0"], ["h1", "t1"], ["h2", "t2"]]
    # without seconds the collected order, as before
    plain = worksteal_shares(spread_heavy(items, 4, lambda item: item.startswith("h")), 4)
    assert [share[:2] for share in plain[:3]] == [["h0", "t0"], ["h1", "t7"], ["h2", "t14"]]
