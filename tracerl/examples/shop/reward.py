"""Reward for shopping: 1.0 when the answer's last number is the total."""

from __future__ import annotations

import re


def reward(task: dict, answer: str) -> float:
    """`task` is the whole task record; `answer` the agent's text."""
    numbers = re.findall(r"\d+", answer or "")
    return 1.0 if numbers and numbers[-1] == str(task["answer"]) else 0.0
