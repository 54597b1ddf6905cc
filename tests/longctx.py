"""Shared by the long-context, framework and CLI tests: the long-context model (built once
into $TRACERL_HOME), a gateway serving it, and the checks every recorded call must pass."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracerl.engines.scoring import constraint_of, score_completion
from tracerl.roles import GatewayConfig
from tracerl.stack import LocalStack, start_multi_stack
from tracerl.types import Span

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def long_model_dir() -> Path:
    """The long-context test model (built once, ~2 min, then cached)."""
    os.environ.setdefault("TRACERL_HOME", str(ROOT / ".tracerl"))
    from tracerl.models.longctx import ensure_long_context_model

    return ensure_long_context_model()


@pytest.fixture
def long_stack(long_model_dir: Path, tmp_path: Path) -> Iterator[LocalStack]:
    """A gateway serving the model as "policy", answering any other model name too (clients
    hard-code theirs), recording every call (sessions included) into a SQLite store."""
    cfg = GatewayConfig(default_model="policy")
    stack = start_multi_stack(
        {"policy": long_model_dir}, {"policy": "policy"}, tmp_path / "traces.db", gateway_cfg=cfg
    )
    yield stack
    stack.close()


def all_spans(stack: LocalStack) -> list[Span]:
    """Every recorded span, rollout by rollout, in call order."""
    return [s for r in stack.store.rollouts() for s in stack.store.spans(r.id)]


def worst_rescore(model_dir: Path, spans: list[Span]) -> float:
    """Largest |recorded - re-scored| log-prob over the spans' sampled tokens."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    worst = 0.0
    for span in spans:
        # A constrained call (smolagents' tool_choice "required") was sampled from the masked
        # distribution: re-score it under the same grammar, as the trainer must.
        rescored = score_completion(
            model, span.prompt_ids, span.completion_ids, span.temperature,
            constraint_of(span), tokenizer,
        )  # fmt: skip
        for a, b in zip(rescored, span.logprobs, strict=True):
            worst = max(worst, abs(a - b))
    return worst


def summary(name: str, spans: list[Span]) -> str:
    """One report line: calls, prompt tokens per call, prefix breaks and their reasons."""
    breaks = [s.prefix_break for s in spans if s.prefix_break]
    tokens = [len(s.prompt_ids) for s in spans]
    return f"{name}: {len(spans)} calls, prompt tokens {tokens}, prefix breaks {breaks}"


def check_recorded(spans: list[Span]) -> None:
    """Every call recorded with its exact ids and one log-prob per sampled token."""
    assert spans, "no call was recorded"
    for s in spans:
        assert s.prompt_ids and s.completion_ids
        assert len(s.logprobs) == len(s.completion_ids)
