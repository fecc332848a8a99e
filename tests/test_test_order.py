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
