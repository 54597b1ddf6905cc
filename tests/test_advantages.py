"""Advantages and per-rollout weights, checked against plain-Python references."""

from __future__ import annotations

import math

import pytest

from tracerl.algorithms.advantages import GRPO, RLOO, DrGRPO, compute_advantages
from tracerl.types import REWARD_LIMIT, Transition


def row(
    rollout: str, reward: float, mask: list[int], *, group: str = "g", role: str = "policy"
) -> Transition:
    n = len(mask)
    return Transition(
        rollout_id=rollout,
        group_id=group,
        task_id=group,
        role=role,
        input_ids=list(range(n)),
        loss_mask=mask,
        behaviour_logprobs=[-0.5 * m for m in mask],
        versions=[0 if m else -1 for m in mask],
        advantages=[0.0] * n,
        reward=reward,
        span_ids=[f"{rollout}-s"],
        num_spans=1,
    )


def ref_std(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def per_row_adv(rows: list[Transition]) -> dict[tuple[str, int], float]:
    """The scalar each row carries, checking it sits on sampled tokens only."""
    out = {}
    for i, r in enumerate(rows):
        vals = {a for a, m in zip(r.advantages, r.loss_mask, strict=True) if m}
        assert all(a == 0.0 for a, m in zip(r.advantages, r.loss_mask, strict=True) if not m)
        assert len(vals) <= 1
        out[(r.rollout_id, i)] = vals.pop() if vals else 0.0
    return out


GROUP = [
    row("a", 1.0, [0, 1, 1]),
    row("b", 0.0, [0, 0, 1, 1, 1]),
    row("c", 0.5, [0, 1]),
    row("d", 0.0, [1]),
]
REWARDS = [1.0, 0.0, 0.5, 0.0]


def test_grpo_matches_reference() -> None:
    out = compute_advantages(GRPO(), GROUP)
    mean, std = sum(REWARDS) / 4, ref_std(REWARDS)
    got = per_row_adv(out)
    for i, r in enumerate(REWARDS):
        assert got[("abcd"[i], i)] == pytest.approx((r - mean) / (std + 1e-6), rel=1e-12)
    unscaled = per_row_adv(compute_advantages(GRPO(scale_by_std=False), GROUP))
    assert [unscaled[("abcd"[i], i)] for i in range(4)] == pytest.approx(
        [r - mean for r in REWARDS]
    )


def test_rloo_matches_reference() -> None:
    got = per_row_adv(compute_advantages(RLOO(), GROUP))
    for i, r in enumerate(REWARDS):
        others = [REWARDS[j] for j in range(4) if j != i]
        assert got[("abcd"[i], i)] == pytest.approx(r - sum(others) / 3, rel=1e-12)


def test_drgrpo_is_unnormalised_and_leaves_weights_alone() -> None:
    out = compute_advantages(DrGRPO(), GROUP)
    got = per_row_adv(out)
    assert [got[("abcd"[i], i)] for i in range(4)] == pytest.approx([r - 0.375 for r in REWARDS])
    assert all(r.weight == 1.0 for r in out)


@pytest.mark.parametrize("algo", [GRPO(), GRPO(scale_by_std=False), RLOO(), DrGRPO()])
def test_zero_variance_group_gives_zero_advantages(algo) -> None:
    same = [row(x, 0.7, [0, 1, 1]) for x in "abc"]
    assert all(a == 0.0 for r in compute_advantages(algo, same) for a in r.advantages)


def test_single_rollout_group_gives_zero_advantages() -> None:
    for algo in (GRPO(), RLOO(), DrGRPO()):
        assert all(
            a == 0.0
            for r in compute_advantages(algo, [row("a", 1.0, [0, 1])])
            for a in r.advantages
        )


# Rollout "x" has one row with 6 sampled tokens; rollout "y" has three rows (prefix breaks)
# with 2 + 3 + 4 sampled tokens.
UNEVEN = [
    row("x", 1.0, [0, 1, 1, 1, 1, 1, 1]),
    row("y", 0.0, [0, 1, 1]),
    row("y", 0.0, [0, 0, 1, 1, 1]),
    row("y", 0.0, [0, 1, 1, 1, 1]),
]


def test_token_normalisation_gives_each_rollout_unit_token_mass() -> None:
    out = compute_advantages(GRPO(normalize="token"), UNEVEN)
    mass: dict[str, float] = {}
    for r in out:
        mass[r.rollout_id] = mass.get(r.rollout_id, 0.0) + r.weight * sum(r.loss_mask)
    assert mass == pytest.approx({"x": 1.0, "y": 1.0})
    assert [r.weight for r in out] == pytest.approx([1 / 6, 1 / 9, 1 / 9, 1 / 9])


def test_sequence_normalisation_gives_each_rollout_unit_row_mass() -> None:
    out = compute_advantages(GRPO(normalize="sequence"), UNEVEN)
    assert [r.weight for r in out] == pytest.approx([1.0, 1 / 3, 1 / 3, 1 / 3])


def test_rollout_return_is_mean_of_its_rows_and_rows_keep_their_own_reward() -> None:
    rows = [row("a", 1.0, [0, 1]), row("a", 2.0, [0, 1]), row("b", 0.0, [1])]
    got = per_row_adv(compute_advantages(DrGRPO(), rows))
    mean = (1.5 + 0.0) / 2  # rollout returns: a = mean(1, 2), b = 0
    assert [got[k] for k in sorted(got)] == pytest.approx([1.0 - mean, 2.0 - mean, 0.0 - mean])


def test_groups_and_roles_are_separate_baselines() -> None:
    rows = [
        row("a", 1.0, [1], group="g1"),
        row("b", 0.0, [1], group="g1"),
        row("c", 5.0, [1], group="g2"),
        row("d", 3.0, [1], group="g2"),
        row("a", 1.0, [1], group="g1", role="critic"),
        row("b", 1.0, [1], group="g1", role="critic"),
    ]
    out = compute_advantages(DrGRPO(), rows)
    adv = {(r.rollout_id, r.role): r.advantages[0] for r in out}
    assert adv == {
        ("a", "policy"): 0.5,
        ("b", "policy"): -0.5,
        ("c", "policy"): 1.0,
        ("d", "policy"): -1.0,
        ("a", "critic"): 0.0,
        ("b", "critic"): 0.0,
    }


@pytest.mark.parametrize("algo", [GRPO(), RLOO(), DrGRPO()], ids=["grpo", "rloo", "drgrpo"])
@pytest.mark.parametrize(
    "rewards",
    [[1e308, 1e308, 0.0, 0.0], [-1e308, 1e308, 0.0, 1.0], [math.inf, 0.0, math.nan, 1.0]],
    ids=["huge", "huge-both-signs", "non-finite"],
)
def test_extreme_rewards_give_finite_advantages(algo, rewards: list[float]) -> None:  # type: ignore[no-untyped-def]
    """Regression: GRPO over [1e308, 1e308, 0, 0] raised OverflowError and RLOO gave -inf.
    What an in-process reward function returns never passes the API's bound: the advantage
    code reads a reward beyond REWARD_LIMIT as the limit, and NaN as 0 (a missing one)."""
    group = [row(f"r{i}", r, [0, 1, 1]) for i, r in enumerate(rewards)]
    out = per_row_adv(compute_advantages(algo, group))
    assert all(math.isfinite(a) for a in out.values())
    bounded = [0.0 if math.isnan(r) else max(-REWARD_LIMIT, min(REWARD_LIMIT, r)) for r in rewards]
    like = per_row_adv(compute_advantages(algo, [row(f"r{i}", r, [0, 1, 1])
                                                 for i, r in enumerate(bounded)]))  # fmt: skip
    assert out == like
    ranks = sorted(range(4), key=lambda i: bounded[i])
    assert [out[(f"r{i}", i)] for i in ranks] == sorted(out.values())  # higher reward, higher A


def test_grpo_is_scale_free_up_to_the_limit() -> None:
    small = per_row_adv(compute_advantages(GRPO(), [row(f"r{i}", r, [1]) for i, r in
                                                    enumerate([1.0, 1.0, 0.0, 0.0])]))  # fmt: skip
    big = per_row_adv(compute_advantages(GRPO(), [row(f"r{i}", r, [1]) for i, r in
                                                  enumerate([1e308, 1e308, 0.0, 0.0])]))  # fmt: skip
    assert big == pytest.approx(small, rel=1e-5)
