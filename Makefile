# Two commands on a fresh machine: `make demo` and `make test`. Both install what they need
# (once; re-running is cheap) into .venv from this project's own files.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch first, pinned, so nothing pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,bench]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/tracerl demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy tracerl

test: lint
	$(BIN)/pytest -q

bench: install
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,bench]'
	$(BIN)/python bench/gateway.py
	$(BIN)/python bench/store.py
	$(BIN)/python bench/engine.py
