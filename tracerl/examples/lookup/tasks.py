"""Lookup tasks over a small local corpus of made-up towns: "What is the population of
Velmar?" The corpus is fixed (seed 0), so the agent's search tool and the tasks agree.
Usage: python tasks.py N split > tasks.jsonl ({"id", "input": {"question"}, "answer", "split"})."""

from __future__ import annotations

import json
import random
import sys

SYLLABLES = ["vel", "mar", "zor", "ka", "len", "dru", "sa", "tho", "rin", "qua", "bel", "nox"]
FIELDS = ("population", "altitude")


def _corpus() -> dict[str, dict[str, int]]:
    rng = random.Random(0)
    towns: dict[str, dict[str, int]] = {}
    while len(towns) < 120:
        name = "".join(rng.choice(SYLLABLES) for _ in range(2)).capitalize()
        towns[name] = {"population": rng.randint(1000, 99999), "altitude": rng.randint(10, 4999)}
    return towns


CORPUS = _corpus()
"""Town -> facts; what the search tool reads."""


def make_tasks(n: int, split: str, seed: int) -> list[dict]:
    """n questions about random towns and fields."""
    rng = random.Random(seed)
    names = sorted(CORPUS)
    out = []
    for i in range(n):
        town, field = rng.choice(names), rng.choice(FIELDS)
        question = f"What is the {field} of {town}?"
        out.append({"id": f"{split}-{i}", "input": {"question": question},
                    "answer": CORPUS[town][field], "split": split})  # fmt: skip
    return out


if __name__ == "__main__":
    for task in make_tasks(int(sys.argv[1]), sys.argv[2], 0 if sys.argv[2] == "train" else 1):
        print(json.dumps(task))
