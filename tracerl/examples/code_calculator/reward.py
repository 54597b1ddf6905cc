"""Reward for the code-calculator tasks: 1.0 when the final answer is the expected text."""

from __future__ import annotations


def _normal(text: str) -> str:
    """The last non-empty line, without surrounding spaces, quotes, backticks or a final
    period: the forms a right answer may come wrapped in."""
    lines = [line for line in (text or "").splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    return last.rstrip(".").strip("`'\" ")


def reward(task: dict, answer: str) -> float:
    """Exact match of the answer's last line against the task's reference answer."""
    return 1.0 if _normal(answer) == _normal(str(task["answer"])) else 0.0
