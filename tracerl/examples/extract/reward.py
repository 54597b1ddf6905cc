"""Reward for extraction: 1.0 when the answer holds a JSON object whose name and age are
the record's (other keys allowed; the age may be a number or its digits as text)."""

from __future__ import annotations

import json
import re


def reward(task: dict, answer: str) -> float:
    """`task` is the whole task record; `answer` the agent's text."""
    match = re.search(r"\{.*\}", answer or "", re.DOTALL)
    if not match:
        return 0.0
    try:
        got = json.loads(match.group(0))
    except json.JSONDecodeError:
        return 0.0
    want = task["answer"]
    if not isinstance(got, dict):
        return 0.0
    return float(got.get("name") == want["name"] and str(got.get("age")) == str(want["age"]))
