"""Synthetic training rows of calculator length, shared by the trainer benches (dp, mfu)."""

from __future__ import annotations

import random
from collections.abc import Callable

from tracerl.types import Transition


def calculator_rows(
    rng: random.Random,
    n: int,
    vocab: int,
    weight: Callable[[list[int]], float],
    min_len: int = 100,
    max_len: int = 300,
) -> list[Transition]:
    """`n` rows of uniform min_len..max_len tokens, ~half sampled, random advantages.

    Token values do not change the work (or the FLOPs), so they are random too. `weight`
    gives each row's weight from its loss mask; it is called last for each row, so it may
    draw from `rng` too.
    """
    rows = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        mask = [0] + [int(rng.random() < 0.55) for _ in range(length - 1)]
        rows.append(
            Transition(
                rollout_id=f"r{i}",
                group_id="g",
                task_id="t",
                role="policy",
                input_ids=[rng.randrange(vocab) for _ in range(length)],
                loss_mask=mask,
                behaviour_logprobs=[-6.0 * m for m in mask],
                versions=[0 if m else -1 for m in mask],
                advantages=[rng.uniform(-1.0, 1.0) * m for m in mask],
                reward=0.0,
                span_ids=[f"s{i}"],
                num_spans=1,
                weight=weight(mask),
            )
        )
    return rows
