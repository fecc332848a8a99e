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

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"{SHARED_DATA} is missing: the tests read Wikitext and tokenizers from ../shared/data")
    return SHARED_DATA


def pytest_collection_modifyitems(config, items):
    # `gpu_slow`: GPU tests of opt-in paths that are slow to compile (FlexAttention, a recorded
    # negative result), kept out of `pytest -m gpu` unless ELEPHANT_GPU_SLOW=1
    if os.environ.get("ELEPHANT_GPU_SLOW") != "1":
        opt_in = pytest.mark.skip(reason="slow opt-in GPU test: set ELEPHANT_GPU_SLOW=1 to run it")
        for item in items:
            if "gpu_slow" in item.keywords:
                item.add_marker(opt_in)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run benchmarks/gpu.sh on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
