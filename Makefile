# One virtual environment for everything; torch==2.13.0 takes the CPU build from the local disk
# on our CPU machines (a bare `torch` would pull a multi-GB CUDA build).
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: setup test quickstart clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/.installed

test: setup
	$(BIN)/python -m pytest -q tests

quickstart: setup
	$(BIN)/python train.py --config configs/default.toml
	$(BIN)/python eval.py --checkpoint runs/default --max-docs 8

clean:
	rm -rf $(VENV) cache runs
