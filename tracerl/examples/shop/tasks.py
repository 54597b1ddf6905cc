"""Two-tool shopping tasks: "How much do 4 kettles cost?" needs the `price` tool (a fixed
price list) and then the `calculator` tool for quantity x price.
Usage: python tasks.py N split > tasks.jsonl."""

from __future__ import annotations

import json
import random
import sys

ITEMS = ("kettle", "lamp", "chair", "rug", "clock", "vase", "mug", "fan", "pan", "bowl")
PRICES = {item: random.Random(f"price-{item}").randint(3, 49) for item in ITEMS}
"""Item -> unit price; what the price tool reads."""


def make_tasks(n: int, split: str, seed: int) -> list[dict]:
    """n questions: a quantity of 2-9 of an item; the answer is the total."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        item, qty = rng.choice(ITEMS), rng.randint(2, 9)
        question = f"How much do {qty} {item}s cost?"
        out.append({"id": f"{split}-{i}", "input": {"question": question},
                    "answer": qty * PRICES[item], "split": split})  # fmt: skip
    return out


if __name__ == "__main__":
    for task in make_tasks(int(sys.argv[1]), sys.argv[2], 0 if sys.argv[2] == "train" else 1):
        print(json.dumps(task))
