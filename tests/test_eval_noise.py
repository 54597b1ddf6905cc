"""The evaluation report's sampling noise of one pass (`EvalReport.pass_se`)."""

from __future__ import annotations

import random
import statistics

import pytest

from tracerl.evaluate import pass_standard_error
from tracerl.types import Rollout, RolloutStatus


def _rollouts(wins: dict[str, list[bool]]) -> list[Rollout]:
    return [
        Rollout(id=f"{task}-{i}", task_id=task, status=RolloutStatus.succeeded, reward=float(w))
        for task, ws in wins.items()
        for i, w in enumerate(ws)
    ]


def test_tasks_always_or_never_solved_add_no_noise() -> None:
    # Three tasks always solved, one never: every pass reads 75%.
    wins = {"a": [True] * 4, "b": [True] * 4, "c": [True] * 4, "d": [False] * 4}
    assert pass_standard_error(_rollouts(wins)) == 0.0
    # One rollout per task says nothing about the noise.
    assert pass_standard_error(_rollouts({"a": [True], "b": [False]})) is None


def test_one_task_solved_half_the_time() -> None:
    # k (r - k) / (r (r - 1)) = 2 * 2 / 12 = 1/3, over 2 tasks: sqrt(1/3) / 2.
    wins = {"a": [True, False, True, False], "b": [True] * 4}
    assert pass_standard_error(_rollouts(wins)) == pytest.approx((1 / 3) ** 0.5 / 2)


def test_it_matches_the_spread_of_simulated_passes() -> None:
    """200 tasks with success rates from a skewed spread (most solved nearly always); the
    estimate from 4 repeats each is within 25% of the true spread of one pass."""
    rng = random.Random(0)
    p = [min(1.0, rng.betavariate(0.6, 0.15)) for _ in range(200)]
    true_se = sum(q * (1 - q) for q in p) ** 0.5 / len(p)
    passes = [statistics.fmean(rng.random() < q for q in p) for _ in range(2000)]
    assert statistics.stdev(passes) == pytest.approx(true_se, rel=0.1)
    wins = {f"t{i}": [rng.random() < q for _ in range(4)] for i, q in enumerate(p)}
    estimate = pass_standard_error(_rollouts(wins))
    assert estimate is not None and estimate == pytest.approx(true_se, rel=0.25)
