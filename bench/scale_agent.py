"""bench/scale.py's agent: a 0.5 s tool call on every rollout (fetching the task's context,
say), then the calculator example agent, unchanged. Its rollouts wait on the tool, not on
the CPU or the model, as agents calling real tools do."""

from __future__ import annotations

import time
from typing import Any

from tracerl.agents import load_file
from tracerl.examples import example_file

TOOL_S = 0.5
_calculator = load_file(example_file("calculator", "agent"))


def run(task: dict, **kwargs: Any) -> str:
    time.sleep(TOOL_S)
    return _calculator.run(task, **kwargs)
