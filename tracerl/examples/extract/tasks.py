"""Extraction tasks: read a record with a `read` tool and answer with a JSON object of the
person's name and age. The records are fixed (seed 0), shared by the tool and the tasks.
Usage: python tasks.py N split > tasks.jsonl."""

from __future__ import annotations

import json
import random
import sys

FIRST = ("Ada", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Ivy", "Jo", "Kai", "Lu", "Max")
LAST = ("Vel", "Mar", "Zor", "Ka", "Len", "Dru", "Sato", "Thorn", "Rin", "Quay")
TOWNS = ("Velm", "Zorka", "Lenbury", "Kadru", "Marsh")


def _records() -> dict[str, dict]:
    rng = random.Random(0)
    return {
        f"R{k}": {"name": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "age": rng.randint(18, 89),
                  "town": rng.choice(TOWNS)}
        for k in range(10, 90)
    }  # fmt: skip


RECORDS = _records()
"""Record id -> person; what the read tool returns as prose."""


def make_tasks(n: int, split: str, seed: int) -> list[dict]:
    """n extraction requests; the answer is {"name", "age"}."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        rid = rng.choice(sorted(RECORDS))
        person = RECORDS[rid]
        answer = {"name": person["name"], "age": person["age"]}
        out.append({"id": f"{split}-{i}", "input": {"question": f"Give record {rid} as JSON."},
                    "answer": answer, "split": split})  # fmt: skip
    return out


if __name__ == "__main__":
    for task in make_tasks(int(sys.argv[1]), sys.argv[2], 0 if sys.argv[2] == "train" else 1):
        print(json.dumps(task))
