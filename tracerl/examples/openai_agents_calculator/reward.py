"""Reward for the calculator task: 1.0 when the final answer is the right number."""

from __future__ import annotations

import re


def reward(task: dict, answer: str) -> float:
    """Exact match of the last integer in the answer against the task's reference answer."""
    numbers = re.findall(r"-?\d+", answer or "")
    return 1.0 if numbers and numbers[-1] == str(task["answer"]) else 0.0
