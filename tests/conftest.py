"""Shared test setup: Triton kernels run in the interpreter when there is no GPU; paths to ../shared."""
import logging
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Small shapes on a 2-core machine: two OpenMP threads contend (with each other and with the
# subprocesses some tests start) and make every op many times slower than one thread.
torch.set_num_threads(1)

if torch.cuda.is_available():
    # The GPU tests check values, gradients and recompiles, not which launch is fastest. Inductor
    # compiles two or six launch configurations of each pointwise kernel to time them; one is
    # enough here, and the GPU suite is bound by the host compiling Triton kernels.
    # Likewise one configuration of each reduction instead of up to seven (the pick inductor makes
    # in its deterministic mode; a test switch of inductor's own, where this torch has it).
    import torch._inductor.config as inductor_config
    inductor_config.triton.autotune_pointwise = False
    if hasattr(getattr(inductor_config, "test_configs", None), "force_filter_reduction_configs"):
        inductor_config.test_configs.force_filter_reduction_configs = True

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


@pytest.hookimpl(trylast=True)   # after `-m` has deselected: the order is of the tests that run
def pytest_collection_modifyitems(config, items):
    # `gpu_slow`: GPU tests of opt-in paths that are slow to compile (FlexAttention, a recorded
    # negative result), kept out of `pytest -m gpu` unless ELEPHANT_GPU_SLOW=1
    if os.environ.get("ELEPHANT_GPU_SLOW") != "1":
        opt_in = pytest.mark.skip(reason="slow opt-in GPU test: set ELEPHANT_GPU_SLOW=1 to run it")
        for item in items:
            if "gpu_slow" in item.keywords:
                item.add_marker(opt_in)
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        items[:] = spread_heavy(items, workers, lambda item: "heavy" in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run benchmarks/gpu.sh on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def spread_heavy(items: list, workers: int, heavy) -> list:
    """The collected tests reordered for pytest-xdist's worksteal, which hands each worker a
    contiguous share at the start (len(pending) // workers left, worker by worker): the `heavy`
    tests (long compiles, marked so) dealt one per share in turn, at the share's head, so that they
    start at once instead of queueing behind each other; the others fill the shares in their order.
    The GPU suite ends when its longest compiles do. Every worker computes the same order, as xdist
    requires."""
    long = [item for item in items if heavy(item)]
    rest = [item for item in items if not heavy(item)]
    sizes, left = [], len(items)
    for w in range(workers):
        sizes.append(left // (workers - w))
        left -= sizes[-1]
    heads = [long[w::workers][:size] for w, size in enumerate(sizes)]
    spare = [item for w, size in enumerate(sizes) for item in long[w::workers][size:]]
    rest = spare + rest   # heavy tests that no share had room for (more than its size)
    out = []
    for head, size in zip(heads, sizes):
        out += head + rest[:size - len(head)]
        del rest[:size - len(head)]
    return out


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
