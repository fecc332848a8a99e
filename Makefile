# One virtual environment for everything; torch==2.13.0 takes the CPU build from the local disk
# on our CPU machines (a bare `torch` would pull a multi-GB CUDA build).
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
TORCH ?= torch==2.13.0
# test processes (pytest-xdist): each test runs on one thread (tests/conftest.py), so two
# processes keep both cores of a CI machine busy; TEST_WORKERS=0 runs the suite in one process
TEST_WORKERS ?= 2

.PHONY: setup test quickstart clean

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

clean:
	rm -rf $(VENV) cache runs
