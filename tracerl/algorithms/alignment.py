"""Trajectory alignment (M-GRPO): the same number of rows per rollout for a role.

A planner may call its executor 0, 1 or 5 times, so without alignment the executor's rows
per rollout vary with the planner's behaviour, and so does the executor's batch. With
`align = {"executor": D}` every rollout that called the executor gives exactly D executor
rows: beyond D, rows are dropped at random; below D, the rollout's own rows are copied at
random until it has D. A copy is a real row of that rollout (same tokens, same reward),
never padding, so nothing foreign reaches the loss, and the role's batch is D x (rollouts
that called it) rows. A rollout that never called the role has no row to copy and gives
none. The draw is seeded by rollout and role, so a resumed step aligns the same way.

Alignment runs before the algorithm's hooks: the per-rollout weights then spread each
rollout's unit weight over its D rows, and a rollout's return is the mean reward of its
aligned rows (its outcome, unless step rewards differ between its rows).
"""

from __future__ import annotations

import random

from tracerl.types import Transition

__all__ = ["align_rows"]


def align_rows(rows: list[Transition], size: int, key: str) -> list[Transition]:
    """Exactly `size` of one rollout's rows of one role (none if it has none), in call order
    with copies placed after their originals; `key` seeds the draw."""
    if size < 1:
        raise ValueError(f"alignment size must be >= 1, got {size}")
    if not rows or len(rows) == size:
        return rows
    rng = random.Random(key)
    if len(rows) > size:
        kept = sorted(rng.sample(range(len(rows)), size))
    else:
        kept = sorted([*range(len(rows)), *rng.choices(range(len(rows)), k=size - len(rows))])
    return [rows[i] for i in kept]
