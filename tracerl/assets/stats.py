"""Paired outcomes and their significance: repairs, regressions, and two paired tests.

Two versions run on the same task attempts with the same seeds give pairs of outcomes. A
pair where both succeed or both fail says nothing about which is better; the discordant
ones do: a repair (B succeeds where A failed) or a regression (A succeeds where B fails).

- Exact McNemar: under "A and B are equally good" each discordant pair is a repair with
  probability 1/2, so the repairs among n discordant pairs are Binomial(n, 1/2); the
  two-sided p-value is 2 P(X <= min(repairs, regressions)), capped at 1 (what
  scipy.stats.binomtest(min, n, 0.5).pvalue gives; tests/test_assets_stats.py checks).
- Bootstrap: resample tasks with replacement (the repeats of a task stay together, since
  they share the task's difficulty) and read how often the resampled difference of success
  rates lies as far from the observed one as the observed one lies from 0.

Pure functions, no scipy: exact integers (math.comb) for the binomial tail.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from fractions import Fraction

from tracerl.assets.records import Pair, Test

__all__ = ["bootstrap_p", "discordant", "mcnemar_p", "p_value", "success_rate"]

BOOTSTRAP_RESAMPLES = 10_000
"""Resamples of the bootstrap test (its p-value resolves to about 1e-4)."""


def discordant(pairs: Sequence[Pair]) -> tuple[int, int]:
    """(repairs, regressions): pairs B solves and A does not, and the reverse."""
    repairs = sum(1 for p in pairs if p.b and not p.a)
    regressions = sum(1 for p in pairs if p.a and not p.b)
    return repairs, regressions


def success_rate(pairs: Sequence[Pair], arm: str) -> float:
    """Arm "a"'s or "b"'s share of successes (0 for no pairs)."""
    wins = sum(1 for p in pairs if (p.a if arm == "a" else p.b))
    return wins / len(pairs) if pairs else 0.0


def mcnemar_p(repairs: int, regressions: int) -> float:
    """Exact two-sided McNemar p-value: 2 P(Binomial(n, 1/2) <= min), capped at 1, with n
    the discordant pairs (1 when there are none)."""
    if repairs < 0 or regressions < 0:
        raise ValueError("counts must be non-negative")
    n = repairs + regressions
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(repairs, regressions) + 1))
    return float(min(Fraction(1), Fraction(2 * tail, 2**n)))


def bootstrap_p(
    pairs: Sequence[Pair], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> float:
    """Two-sided bootstrap p-value of the paired difference of success rates, resampling
    tasks: the share of resampled differences d* with |d* - d| >= |d| (d the observed one),
    counted with the observed sample itself ((k + 1) / (B + 1)); 1 when d is 0."""
    by_task: dict[str, list[int]] = {}
    for p in pairs:
        by_task.setdefault(p.task_id, []).append(int(p.b) - int(p.a))
    groups = [(sum(v), len(v)) for v in by_task.values()]
    if not groups:
        return 1.0
    observed = sum(s for s, _ in groups) / sum(n for _, n in groups)
    if observed == 0:
        return 1.0
    rng = random.Random(seed)
    far = 0
    for _ in range(resamples):
        drawn = rng.choices(groups, k=len(groups))
        d = sum(s for s, _ in drawn) / sum(n for _, n in drawn)
        far += abs(d - observed) >= abs(observed)
    return (far + 1) / (resamples + 1)


def p_value(pairs: Sequence[Pair], test: Test, seed: int = 0) -> float:
    """The p-value of `test` over the pairs."""
    if test == "mcnemar":
        return mcnemar_p(*discordant(pairs))
    return bootstrap_p(pairs, seed=seed)
