"""The paired tests behind every comparison: exact McNemar equals scipy's binomial test on
known tables, and the bootstrap of the paired difference behaves as a test should."""

from __future__ import annotations

import pytest
from scipy.stats import binomtest

from tracerl.assets.records import Pair
from tracerl.assets.stats import bootstrap_p, discordant, mcnemar_p, p_value, success_rate


def pairs(table: list[tuple[bool, bool, int]], tasks: int | None = None) -> list[Pair]:
    """Pairs of the (a, b, count) table, spread over `tasks` tasks (default: one task
    each)."""
    out: list[Pair] = []
    for a, b, count in table:
        for _ in range(count):
            i = len(out)
            task = f"t{i % tasks if tasks else i}"
            out.append(Pair(task_id=task, repeat=0, a=a, b=b, rollout_a=f"a{i}", rollout_b=f"b{i}"))
    return out


@pytest.mark.parametrize(
    "repairs, regressions",
    [(0, 0), (1, 0), (0, 1), (3, 3), (5, 1), (1, 5), (10, 2), (12, 30), (50, 49), (7, 0),
     (0, 25), (120, 80), (400, 350), (1, 1), (2, 9)],
)  # fmt: skip
def test_exact_mcnemar_equals_scipys_binomial_test(repairs: int, regressions: int) -> None:
    n = repairs + regressions
    expected = 1.0 if n == 0 else binomtest(min(repairs, regressions), n, 0.5).pvalue
    assert mcnemar_p(repairs, regressions) == pytest.approx(expected, rel=1e-12, abs=0)


def test_a_table_reads_as_repairs_regressions_and_rates() -> None:
    table = pairs([(True, True, 6), (False, True, 5), (True, False, 1), (False, False, 8)])
    assert discordant(table) == (5, 1)
    assert success_rate(table, "a") == pytest.approx(7 / 20)
    assert success_rate(table, "b") == pytest.approx(11 / 20)
    assert p_value(table, "mcnemar") == pytest.approx(binomtest(1, 6, 0.5).pvalue)
    with pytest.raises(ValueError):
        mcnemar_p(-1, 2)


def test_the_bootstrap_finds_a_clear_difference_and_not_a_null_one() -> None:
    clear = pairs([(False, True, 30), (True, True, 10), (False, False, 10)], tasks=50)
    assert bootstrap_p(clear, resamples=2000) < 0.01
    balanced = pairs([(False, True, 6), (True, False, 6), (True, True, 20)], tasks=32)
    assert bootstrap_p(balanced, resamples=2000) == 1.0  # no difference at all
    noisy = pairs([(False, True, 4), (True, False, 3), (True, True, 10)], tasks=17)
    assert bootstrap_p(noisy, resamples=2000) > 0.5
    # Seeded: the same pairs give the same p-value.
    assert bootstrap_p(noisy, seed=3) == bootstrap_p(noisy, seed=3)


def test_the_bootstrap_keeps_a_tasks_repeats_together() -> None:
    # Ten repairs, all on one task: pair by pair they look decisive (McNemar), but one task
    # in 11 carries the whole difference, so resampling tasks rightly doubts it.
    one_task = pairs([(False, True, 10)], tasks=1) + [
        Pair(task_id=f"u{i}", repeat=0, a=True, b=True, rollout_a="x", rollout_b="y")
        for i in range(10)
    ]
    assert p_value(one_task, "mcnemar") < 0.01
    assert p_value(one_task, "bootstrap") > 0.05
