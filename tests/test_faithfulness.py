"""Token faithfulness over real multi-turn calculator rollouts through the whole spine.

The calculator agent (plain openai client code) runs against the gateway serving the
warm-started tiny model on the batching hf engine. Every recorded span must be exactly what
the policy saw and sampled: re-scoring its prompt + completion ids with the same weights
reproduces the recorded log-probs, and each later call's prompt starts with the earlier
call's prompt + completion ids.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tracerl.agents import python_agent
from tracerl.engines.scoring import score_completion
from tracerl.evaluate import run_rollouts
from tracerl.runner import RunnerConfig
from tracerl.stack import start_stack
from tracerl.types import Task

pytestmark = pytest.mark.slow


def test_spans_are_token_faithful(calculator_skilled_dir: Path, tmp_path: Path) -> None:
    from agent import run
    from reward import reward
    from tasks import make_tasks

    tasks = [Task.model_validate(t) for t in make_tasks(120, "eval", 1)]
    stack = start_stack(calculator_skilled_dir, tmp_path / "traces.db")
    try:
        with ThreadPoolExecutor(32) as threads:
            rollouts = run_rollouts(
                stack.store,
                stack.url,
                python_agent(run, threads),
                reward,
                tasks,
                cfg=RunnerConfig(concurrency=32),
            )
        spans_by_rollout = [stack.store.spans(r.id) for r in rollouts]
    finally:
        stack.close()
    assert len(rollouts) == 120
    multi_turn = [spans for spans in spans_by_rollout if len(spans) >= 2]
    assert len(multi_turn) >= 100, f"only {len(multi_turn)} multi-turn rollouts"

    breaks = 0
    for spans in multi_turn:
        for before, after in zip(spans, spans[1:], strict=False):
            seen = before.prompt_ids + before.completion_ids
            breaks += after.prompt_ids[: len(seen)] != seen or after.prefix_break is not None
    assert breaks == 0

    model = AutoModelForCausalLM.from_pretrained(calculator_skilled_dir, dtype=torch.float32)
    model.eval()
    worst = 0.0
    for spans in multi_turn[:100]:
        for span in spans:
            rescored = score_completion(
                model, span.prompt_ids, span.completion_ids, span.temperature
            )
            diff = max(abs(a - b) for a, b in zip(rescored, span.logprobs, strict=True))
            worst = max(worst, diff)
    print(f"max |logprob diff| over {sum(len(s) for s in multi_turn[:100])} spans: {worst:.2e}")
    assert worst <= 1e-4
