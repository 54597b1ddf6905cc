"""Reward for the text game: 1.0 when the answer's last word is the item in the last room
(reachable only by walking the route: the item is in no prompt)."""

from __future__ import annotations

import re


def reward(task: dict, answer: str) -> float:
    """`task` is the whole task record; `answer` the agent's text."""
    words = re.findall(r"[a-z]+", (answer or "").lower())
    return 1.0 if words and words[-1] == task["answer"] else 0.0
