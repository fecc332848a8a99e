# One virtual environment for everything; torch==2.13.0 takes the CPU build from the local disk
# on our CPU machines (a bare `torch` would pull a multi-GB CUDA build).
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
TORCH ?= torch==2.13.0
# test processes (pytest-xdist): each test runs on one thread (tests/conftest.py), so two
# processes keep both cores of a CI machine busy; TEST_WORKERS=0 runs the suite in one process
TEST_WORKERS ?= 2

.PHONY: setup test quickstart clean field-wheels

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/.installed

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

quickstart: setup
	$(BIN)/python train.py --config configs/default.toml
	$(BIN)/python eval.py --checkpoint runs/default --max-docs 8

# the field's kernels for `benchmarks/gpu.sh field` (carried to the GPU machine, which has no
# index): fla-core's wheel, and mamba-ssm's Python and Triton code as a wheel (on PyPI an sdist
# whose CUDA build takes long; the benchmark needs its Triton scan alone)
field-wheels: setup
	$(BIN)/pip download -q fla-core==0.6.0 einops --no-deps -d .whl
	MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE $(BIN)/pip wheel -q mamba-ssm==2.3.2.post1 \
		--no-deps --no-build-isolation -w .whl

clean:
	rm -rf $(VENV) cache runs
