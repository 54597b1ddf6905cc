"""Text-game tasks: walk a given route through rooms with a `move` tool and say what lies
in the last room. Each task carries its world (rooms and item), which the agent's game
engine reads and the model never sees; only the question and the tool's replies.
Usage: python tasks.py N split > tasks.jsonl."""

from __future__ import annotations

import json
import random
import sys

DIRECTIONS = ("north", "south", "east", "west")
ROOMS = ("hall", "library", "cellar", "attic", "kitchen", "garden", "vault", "tower")
ITEMS = ("lamp", "key", "map", "coin", "sword", "book", "ring", "rope", "mask", "bell")


def make_tasks(n: int, split: str, seed: int) -> list[dict]:
    """n routes of 2-3 moves, each ending by an item."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        route = [rng.choice(DIRECTIONS) for _ in range(rng.randint(2, 3))]
        rooms = rng.sample(ROOMS, len(route))
        item = rng.choice(ITEMS)
        question = f"Go {', then '.join(route)}. What do you find?"
        world = {"route": route, "rooms": rooms, "item": item}
        out.append({"id": f"{split}-{i}", "input": {"question": question, "world": world},
                    "answer": item, "split": split})  # fmt: skip
    return out


if __name__ == "__main__":
    for task in make_tasks(int(sys.argv[1]), sys.argv[2], 0 if sys.argv[2] == "train" else 1):
        print(json.dumps(task))
