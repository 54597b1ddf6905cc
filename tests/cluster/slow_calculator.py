"""The calculator example agent, unchanged, after a 1 s pause (a slow tool): rollouts last
long enough to be in flight when a node is killed."""

from __future__ import annotations

import time
from typing import Any

from tracerl.agents import load_file
from tracerl.examples import example_file

_calculator = load_file(example_file("calculator", "agent"))


def run(task: dict, **kwargs: Any) -> str:
    time.sleep(1.0)
    return _calculator.run(task, **kwargs)
