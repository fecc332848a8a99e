"""Shared test setup: Triton kernels run in the interpreter when there is no GPU; paths to ../shared."""
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
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run benchmarks/gpu.sh on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
