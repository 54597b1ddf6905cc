"""Generates list, string and arithmetic tasks as JSONL: {"id", "input": {"question"},
"answer", "split"}, each answered best by a short Python program.

The answer is the text a correct program prints (a number, a word, or a list as Python
prints it), so the agent can copy the tool's output into its final answer.
Usage: python examples/code_calculator/tasks.py [N] [train|eval] [seed]
"""

from __future__ import annotations

import json
import random
import string
import sys
from collections.abc import Callable

VOWELS = "aeiou"


def _ints(rng: random.Random, low: int = 0, high: int = 9) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(3, 5))]


def _word(rng: random.Random, letters: str = string.ascii_lowercase) -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(5, 9)))


def sum_squares(rng: random.Random) -> tuple[str, str]:
    xs = _ints(rng)
    return f"What is the sum of the squares of {xs}?", str(sum(x * x for x in xs))


def reverse(rng: random.Random) -> tuple[str, str]:
    word = _word(rng)
    return f"Reverse the string '{word}'.", word[::-1]


def count(rng: random.Random) -> tuple[str, str]:
    word = _word(rng, "abcde")
    letter = rng.choice(word)
    return f"How many times does '{letter}' occur in '{word}'?", str(word.count(letter))


def sort(rng: random.Random) -> tuple[str, str]:
    xs = _ints(rng, 0, 99)
    return f"Sort {xs} in ascending order.", str(sorted(xs))


def arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b, c = rng.randint(10, 99), rng.randint(2, 9), rng.randint(1, 99)
    op = rng.choice("+-")
    value = a * b + c if op == "+" else a * b - c
    return f"What is {a}*{b}{op}{c}?", str(value)


def spread(rng: random.Random) -> tuple[str, str]:
    xs = _ints(rng, 0, 99)
    return f"What is the largest number in {xs} minus the smallest?", str(max(xs) - min(xs))


def vowels(rng: random.Random) -> tuple[str, str]:
    word = _word(rng)
    return f"How many vowels are in '{word}'?", str(sum(ch in VOWELS for ch in word))


KINDS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "sum_squares": sum_squares,
    "reverse": reverse,
    "count": count,
    "sort": sort,
    "arithmetic": arithmetic,
    "spread": spread,
    "vowels": vowels,
}
"""Each kind of task: a function drawing (question, answer)."""


def make_task(rng: random.Random, index: int, split: str) -> dict:
    """One task of a random kind."""
    kind = rng.choice(sorted(KINDS))
    question, answer = KINDS[kind](rng)
    return {
        "id": f"{split}-{index}",
        "input": {"question": question},
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
