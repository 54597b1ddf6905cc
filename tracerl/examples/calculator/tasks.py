"""Generates calculator tasks as JSONL: {"id", "input": {"question"}, "answer", "split"}."""

from __future__ import annotations

import json
import random
import sys

OPS = ["+", "-", "*"]


def make_task(rng: random.Random, index: int, split: str) -> dict:
    """One two-operand arithmetic question with its integer answer."""
    op = rng.choice(OPS)
    a = rng.randint(0, 99)
    b = rng.randint(0, 9) if op == "*" else rng.randint(0, 99)
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {
        "id": f"{split}-{index}",
        "input": {"question": f"What is {a}{op}{b}?"},
        "answer": answer,
        "split": split,
    }


def make_tasks(n: int, split: str, seed: int) -> list[dict]:
    """n tasks; train and eval use different seeds so held-out tasks differ."""
    rng = random.Random(seed)
    return [make_task(rng, i, split) for i in range(n)]


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    split = sys.argv[2] if len(sys.argv) > 2 else "train"
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else (0 if split == "train" else 1)
    for task in make_tasks(n, split, seed):
        print(json.dumps(task))
