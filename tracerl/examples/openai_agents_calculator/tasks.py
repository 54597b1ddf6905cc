"""Calculator tasks as JSONL ({"id", "input": {"question"}, "answer", "split"}): the
calculator example's generator, train and eval splits drawn with different seeds.
Usage: python tasks.py N_TRAIN N_EVAL > tasks.jsonl"""

from __future__ import annotations

import json
import sys

from tracerl.examples.calculator.tasks import make_tasks

__all__ = ["make_tasks", "write_tasks"]


def write_tasks(n_train: int, n_eval: int) -> list[dict]:
    """Train tasks (seed 0) and held-out eval tasks (seed 1)."""
    return make_tasks(n_train, "train", 0) + make_tasks(n_eval, "eval", 1)


if __name__ == "__main__":
    n_train = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    n_eval = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    for task in write_tasks(n_train, n_eval):
        print(json.dumps(task))
