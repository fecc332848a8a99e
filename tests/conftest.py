"""Shared test setup: Triton kernels run in the interpreter when there is no GPU; paths to ../shared."""
import json
import logging
import os
import time
from pathlib import Path

import pytest


def pytest_configure(config):
    # pytest-xdist's main process only deals the tests out: torch, imported here by the processes
    # that run them, took ~6 s at the head of a parallel GPU run, before any worker was started
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Small shapes on a 2-core machine: two OpenMP threads contend (with each other and with the
    # subprocesses some tests start) and make every op many times slower than one thread.
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        # The GPU tests check values, gradients and recompiles, not which launch is fastest.
        # Inductor compiles two or six launch configurations of each pointwise kernel to time
        # them; one is enough here, and the GPU suite is bound by the host compiling Triton
        # kernels. Likewise one configuration of each reduction instead of up to seven (the pick
        # inductor makes in its deterministic mode; a test switch of inductor's own, where this
        # torch has it).
        import torch._inductor.config as inductor_config
        inductor_config.triton.autotune_pointwise = False
        if hasattr(config, "workerinput") and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
            inductor_config.compile_threads = 1   # see HEAVY_COMPILE_THREADS
        if hasattr(getattr(inductor_config, "test_configs", None), "force_filter_reduction_configs"):
            inductor_config.test_configs.force_filter_reduction_configs = True


# Inductor's compile processes under pytest-xdist on a GPU host: the workers already fill its
# cores, and a pool in each of them (a torch import each) was work on top (GPU suite 134.5 s with
# them, 114.1 s without; 2026-11-26). The tests marked heavy, the long compiles that end the
# suite, get a pool of HEAVY_COMPILE_THREADS: their kernels compile while inductor writes the
# rest (the trainer's test 94.5 -> 78.8 s, the suite 138.3 -> 127.5 s; 2026-11-27).
# TORCHINDUCTOR_COMPILE_THREADS sets the workers' own, ELEPHANT_HEAVY_COMPILE_THREADS the heavy
# tests' (1: none).
HEAVY_COMPILE_THREADS = 4


@pytest.fixture(autouse=True)
def _heavy_compile_threads(request):
    """A test marked heavy, on an xdist worker, compiles over a pool of HEAVY_COMPILE_THREADS
    processes (inductor makes it at its first compile that wants one, and keeps it)."""
    default = HEAVY_COMPILE_THREADS if os.environ.get("PYTEST_XDIST_WORKER") else 0
    n = int(os.environ.get("ELEPHANT_HEAVY_COMPILE_THREADS", default))
    if n <= 1 or "heavy" not in request.keywords:
        yield
        return
    import torch._inductor.config as inductor_config
    before = inductor_config.compile_threads
    inductor_config.compile_threads = n
    try:
        yield
    finally:
        inductor_config.compile_threads = before


SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"{SHARED_DATA} is missing: the tests read Wikitext and tokenizers from ../shared/data")
    return SHARED_DATA


@pytest.fixture(scope="session")
def free_port():
    """A function returning a TCP port free on 127.0.0.1 now (a process group's rendezvous)."""
    import socket

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    return port


@pytest.fixture(scope="session")
def run_ranks():
    """A function running fn(rank, *args) in `nprocs` spawned processes, as mp.spawn does, that
    fails the test, ending them, if they have not all ended within `timeout` seconds: a collective
    that never completes (a rank that died, a rendezvous gone wrong) must not hang the suite."""
    import torch.multiprocessing as mp

    def run(fn, args: tuple, nprocs: int = 2, timeout: float = 300.0) -> None:
        ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):  # raises if a rank failed
            if time.monotonic() >= deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                pytest.fail(f"{fn.__name__}: its {nprocs} processes had not ended after {timeout:.0f}s")
    return run


@pytest.hookimpl(trylast=True)   # after `-m` has deselected: the order is of the tests that run
def pytest_collection_modifyitems(config, items):
    # `gpu_slow`: GPU tests of opt-in paths that are slow to compile (FlexAttention, a recorded
    # negative result), kept out of `pytest -m gpu` unless ELEPHANT_GPU_SLOW=1
    if os.environ.get("ELEPHANT_GPU_SLOW") != "1":
        opt_in = pytest.mark.skip(reason="slow opt-in GPU test: set ELEPHANT_GPU_SLOW=1 to run it")
        for item in items:
            if "gpu_slow" in item.keywords:
                item.add_marker(opt_in)
    import torch
    cuda = torch.cuda.is_available()
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:   # the GPU tests' seconds order a GPU run only (on the CPU they are skipped)
        measured = _gpu_seconds() if cuda else {}
        items[:] = spread_heavy(items, workers, lambda item: "heavy" in item.keywords,
                                (lambda item: measured.get(item.nodeid)) if measured else None)
    if cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA: run benchmarks/gpu.sh on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


GPU_SECONDS = Path(__file__).with_name("gpu_seconds.json")


def _gpu_seconds() -> dict:
    """Each GPU test's seconds in the last measured run (tests/gpu_seconds.json, written by
    `benchmarks/summarize.py test-timeline --seconds` from a run's timeline), {} without it."""
    try:
        return json.loads(GPU_SECONDS.read_text())
    except (OSError, ValueError):
        return {}


def spread_heavy(items: list, workers: int, heavy, seconds=None) -> list:
    """The collected tests reordered for pytest-xdist's worksteal, which hands each worker a
    contiguous share at the start (len(pending) // workers left, worker by worker) and lets an
    idle worker take the back half of the longest queue, except the test each worker runs next.
    The `heavy` tests (long compiles, marked so) are dealt one per share in turn, at the share's
    head, so that they start at once instead of queueing behind each other. Without `seconds`
    the others fill the shares in their collected order. With it (a test's seconds in the last
    measured run, or None), the test after each heavy one is the quickest measured, and the others
    go longest first (an unmeasured one as the longest) to the share with the least work dealt so
    far, those without a heavy head first, so that the long ones start early and the queues end
    with quick tests to take. The suite ends when its longest compiles do. Every worker computes
    the same order, as xdist requires."""
    long = [item for item in items if heavy(item)]
    rest = [item for item in items if not heavy(item)]
    sizes, left = [], len(items)
    for w in range(workers):
        sizes.append(left // (workers - w))
        left -= sizes[-1]
    heads = [long[w::workers][:size] for w, size in enumerate(sizes)]
    spare = [item for w, size in enumerate(sizes) for item in long[w::workers][size:]]
    if not seconds:
        rest = spare + rest   # heavy tests that no share had room for (more than its size)
        out = []
        for head, size in zip(heads, sizes):
            out += head + rest[:size - len(head)]
            del rest[:size - len(head)]
        return out
    measured = sorted((item for item in rest if seconds(item) is not None), key=seconds)
    quick = measured[:sum(0 < len(head) < size for head, size in zip(heads, sizes))]
    shares = [list(head) + ([quick.pop(0)] if 0 < len(head) < size and quick else [])
              for head, size in zip(heads, sizes)]
    taken = {id(item) for share in shares for item in share}
    longest = max((seconds(item) for item in measured), default=0.0)

    def cost(item) -> float:
        s = seconds(item)
        return longest if s is None else s
    load = [sum(cost(item) for item in share[1:]) for share in shares]
    for item in sorted((item for item in spare + rest if id(item) not in taken), key=cost,
                       reverse=True):
        room = [w for w in range(workers) if len(shares[w]) < sizes[w]]
        w = min(room, key=lambda w: (bool(heads[w]), load[w], w))
        shares[w].append(item)
        load[w] += cost(item)
    return [item for share in shares for item in share]


if os.environ.get("ELEPHANT_TEST_TIMELINE"):
    # Where a parallel run's wall time goes (`benchmarks/summarize.py test-timeline` reads it):
    # each test's start and end on its worker, one JSON line each, and when the worker finished
    # importing
    _CONFTEST_IMPORTED = time.time()

    def _timeline(**record):
        record["worker"] = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.environ["ELEPHANT_TEST_TIMELINE"], "a") as f:
            f.write(json.dumps(record) + "\n")

    def _process_start() -> float:
        """When this process started (Linux: /proc), so that a worker's spawn and its imports
        are told apart; NaN where /proc is not."""
        try:
            with open("/proc/self/stat") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            with open("/proc/stat") as f:
                boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
            return boot + ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError, StopIteration):
            return float("nan")

    def pytest_sessionstart(session):
        _timeline(event="imported", at=_CONFTEST_IMPORTED, started=_process_start())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start = time.time()
        yield
        _timeline(event="test", test=item.nodeid, start=start, stop=time.time())


@pytest.fixture
def fake_hub(monkeypatch, caplog, tmp_path):
    """A local fake of the Hub's upload API (tests/hubserver.py) with the client pointed at it,
    a dummy token in HF_TOKEN (`fake_hub.token`) and the client's caches in tmp_path."""
    import huggingface_hub.constants
    from hubserver import FAKE_TOKEN, FakeHub
    with FakeHub() as server:
        server.token = FAKE_TOKEN
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        # read at import: point the client's own lookups here too, and keep its caches in tmp
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.url)
        monkeypatch.setattr(huggingface_hub.constants, "AGENT_HARNESSES_PATH",
                            str(tmp_path / "hf_home" / ".agent_harnesses.json"), raising=False)
        caplog.set_level(logging.DEBUG)
        yield server
