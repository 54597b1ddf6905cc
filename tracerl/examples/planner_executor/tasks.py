"""Generates multi-step arithmetic tasks as JSONL: {"id", "input": {"question"}, "answer", "split"}.

Each question is a chain: a start number, then two operations (or, for a share
`three_step` of the questions, three) applied in order, written either with brackets ("What is (23+45)*3?") or in words ("Compute 23+45, then
multiply by 3"). `steps` reads a question back into its chain, which is how a planner (or
the scripted expert) splits it into one sub-question per operation.
Usage: python examples/planner_executor/tasks.py [N] [split] [seed] [three_step]
"""

from __future__ import annotations

import json
import random
import re
import sys

OPS = ["+", "-", "*"]
VERBS = {"+": "add", "-": "subtract", "*": "multiply by"}
THREE_STEP = 0.0
"""Default share of questions with three operations instead of two: the weak models are
built on two-step questions; raise it for a harder task with more sub-agents."""

_NUMBER = r"-?\d+"
_SYMBOLIC = re.compile(rf"^What is \(*({_NUMBER})((?:[-+*]\d+\)?)+)\?$")
_WORDS = re.compile(rf"^Compute ({_NUMBER})([-+*])(\d+)((?:, then [a-z ]+ \d+)+)$")


def apply(op: str, a: int, b: int) -> int:
    """a op b."""
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def question_text(start: int, chain: list[tuple[str, int]], words: bool) -> str:
    """The question for `start` followed by the operations of `chain`, in order."""
    if words:
        (op, b), rest = chain[0], chain[1:]
        thens = "".join(f", then {VERBS[o]} {x}" for o, x in rest)
        return f"Compute {start}{op}{b}{thens}"
    text = str(start)
    for i, (op, b) in enumerate(chain):
        text = f"{text}{op}{b}" if i == 0 else f"({text}){op}{b}"
    return f"What is {text}?"


def steps(question: str) -> tuple[int, list[tuple[str, int]]] | None:
    """The start number and the (op, operand) chain of a question; None if it is not one."""
    question = question.strip()
    if match := _SYMBOLIC.match(question):
        chain = re.findall(r"([-+*])(\d+)", match.group(2))
        return int(match.group(1)), [(op, int(b)) for op, b in chain]
    if match := _WORDS.match(question):
        chain = [(match.group(2), int(match.group(3)))]
        words = {v: k for k, v in VERBS.items()}
        for verb, b in re.findall(r", then ([a-z ]+) (\d+)", match.group(4)):
            if verb not in words:
                return None
            chain.append((words[verb], int(b)))
        return int(match.group(1)), chain
    return None


def evaluate(start: int, chain: list[tuple[str, int]]) -> int:
    """The chain's result, applying each operation to the result so far."""
    value = start
    for op, b in chain:
        value = apply(op, value, b)
    return value


def make_task(rng: random.Random, index: int, split: str, three_step: float = THREE_STEP) -> dict:
    """One chained arithmetic question with its integer answer."""
    n_ops = 3 if rng.random() < three_step else 2
    # Small operands keep the numbers a tiny model must copy short (at most 3 digits).
    start = rng.randint(10, 49)
    chain = []
    for _ in range(n_ops):
        op = rng.choice(OPS)
        chain.append((op, rng.randint(2, 5) if op == "*" else rng.randint(1, 19)))
    words = rng.random() < 0.5
    return {
        "id": f"{split}-{index}",
        "input": {"question": question_text(start, chain, words)},
        "answer": evaluate(start, chain),
        "split": split,
    }


def make_tasks(n: int, split: str, seed: int, three_step: float = THREE_STEP) -> list[dict]:
    """n tasks; train and eval use different seeds so held-out tasks differ."""
    rng = random.Random(seed)
    return [make_task(rng, i, split, three_step) for i in range(n)]


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    split = sys.argv[2] if len(sys.argv) > 2 else "train"
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else (0 if split == "train" else 1)
    three_step = float(sys.argv[4]) if len(sys.argv) > 4 else THREE_STEP
    for task in make_tasks(n, split, seed, three_step):
        print(json.dumps(task))
