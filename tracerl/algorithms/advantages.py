"""Advantages: small algorithm classes with a per-rollout and a per-group hook.

An algorithm sees rows (Transitions) and writes two things the loss reads: per-token
`advantages` (on sampled tokens only) and a per-row `weight`. The trainer knows no
algorithm. Each role is its own group: a planner's rows are compared with the other
planners' rows of the same task, an executor's with the executors'.

A rollout's return, for the group statistics, is the mean of its rows' rewards (the final
reward when there are no step rewards); each row's advantage uses its own reward against
the group baseline, so step rewards still separate rows of one rollout. A group whose
rollout returns are all equal (or that has one rollout) gives zero advantages: no signal.
Rewards are read through `bounded_reward` (NaN as 0, beyond +-REWARD_LIMIT as the limit):
the APIs refuse such values, but an in-process reward function can still return one, and
the statistics must stay finite (GRPO over [1e308, 1e308, 0, 0] would overflow).

Per-rollout normalisation ("a rollout with more calls must not weigh more") is a weight on
each sampled token, `Transition.weight`, that the loss uses as a weighted mean (see
`tracerl.trainer.loss.loss_weights`). Each rollout gets total weight 1 in the loss's units:
- normalize="token" (default; pairs with aggregation="token"): weight = 1 / (sampled tokens
  of the rollout), so the loss is the mean over rollouts of each rollout's token mean. It
  depends only on the rollout's sampled tokens, so merged and one-row-per-call forms train
  identically.
- normalize="sequence" (pairs with aggregation="sequence"): weight = 1 / (rows of the
  rollout), so the loss is the mean over rollouts of the mean of the rollout's rows.
- normalize="none": weight 1; a rollout weighs by its tokens (token aggregation) or by its
  rows (sequence aggregation).

`Algorithm.align` (M-GRPO's trajectory alignment, tracerl.algorithms.alignment) first gives
every rollout the same number of rows of a role, before either hook sees them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Literal

from tracerl.algorithms.alignment import align_rows
from tracerl.types import Transition, bounded_reward

__all__ = ["RLOO", "Algorithm", "DrGRPO", "GRPO", "Normalize", "compute_advantages"]

Normalize = Literal["token", "sequence", "none"]


def _with_advantage(row: Transition, adv: float) -> Transition:
    return row.model_copy(update={"advantages": [adv * m for m in row.loss_mask]})


def _rollout_return(rows: list[Transition]) -> float:
    return statistics.fmean(bounded_reward(r.reward) for r in rows)


def _write(
    rollouts: list[list[Transition]], returns: list[float], baselines: list[float], scale: float
) -> list[Transition]:
    """Row advantage = (row reward - its rollout's baseline) * scale, on sampled tokens."""
    if max(returns) == min(returns):
        scale = 0.0  # no spread, no signal (also avoids float dust like 0.7 - mean = 1e-16)
    return [
        _with_advantage(r, (bounded_reward(r.reward) - b) * scale)
        for b, rows in zip(baselines, rollouts, strict=True)
        for r in rows
    ]


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    """Base: writes per-rollout weights; subclasses write advantages in `per_group`."""

    normalize: Normalize = "none"
    """How `per_rollout` weights a rollout's tokens (see the module docstring)."""
    align: dict[str, int] = field(default_factory=dict)
    """Role -> rows each rollout gives that role (M-GRPO trajectory alignment); roles not
    named keep every row."""

    def per_rollout(self, rows: list[Transition]) -> list[Transition]:
        """Hook over one rollout's rows (one role); here: write the normalisation weight."""
        if self.normalize == "none" or not rows:
            return rows
        if self.normalize == "sequence":
            mass = float(len(rows))
        else:
            mass = float(sum(sum(r.loss_mask) for r in rows)) or 1.0
        return [r.model_copy(update={"weight": r.weight / mass}) for r in rows]

    def per_group(self, rollouts: list[list[Transition]]) -> list[Transition]:
        """Hook over one group: rollouts[i] is rollout i's rows; returns all rows."""
        return [row for rows in rollouts for row in rows]


@dataclass(frozen=True, kw_only=True)
class GRPO(Algorithm):
    """A = (R - mean R) / (std R + eps) over the group (sample std, as TRL)."""

    scale_by_std: bool = True
    eps: float = 1e-6
    normalize: Normalize = "token"

    def per_group(self, rollouts: list[list[Transition]]) -> list[Transition]:
        returns = [_rollout_return(rows) for rows in rollouts]
        mean = statistics.fmean(returns)
        std = statistics.stdev(returns) if len(returns) > 1 else 0.0
        scale = 1.0 / (std + self.eps) if self.scale_by_std else 1.0
        return _write(rollouts, returns, [mean] * len(returns), scale)


@dataclass(frozen=True, kw_only=True)
class RLOO(Algorithm):
    """A = R - mean of the other rollouts' returns (leave-one-out baseline)."""

    normalize: Normalize = "token"

    def per_group(self, rollouts: list[list[Transition]]) -> list[Transition]:
        returns = [_rollout_return(rows) for rows in rollouts]
        n, total = len(returns), sum(returns)
        baselines = [(total - ret) / (n - 1) if n > 1 else ret for ret in returns]
        return _write(rollouts, returns, baselines, 1.0)


@dataclass(frozen=True, kw_only=True)
class DrGRPO(Algorithm):
    """Dr. GRPO: A = R - mean R, no std scaling and no per-rollout length normalisation.

    The other half of Dr. GRPO is token aggregation without per-sequence length division:
    use LossConfig(aggregation="token") and, for the paper's constant normaliser, pass a
    fixed `denominator` to `policy_loss` (e.g. batch rows x max tokens).
    """

    normalize: Normalize = "none"

    def per_group(self, rollouts: list[list[Transition]]) -> list[Transition]:
        returns = [_rollout_return(rows) for rows in rollouts]
        return _write(rollouts, returns, [statistics.fmean(returns)] * len(returns), 1.0)


def compute_advantages(algorithm: Algorithm, rows: list[Transition]) -> list[Transition]:
    """Align, then apply both hooks: per (rollout, role), then per (group, role); rows in
    group order."""
    by_rollout: dict[tuple[str, str], list[Transition]] = {}
    for row in rows:
        by_rollout.setdefault((row.rollout_id, row.role), []).append(row)
    by_group: dict[tuple[str, str], list[list[Transition]]] = {}
    for (rollout, role), rollout_rows in by_rollout.items():
        if role in algorithm.align:
            rollout_rows = align_rows(rollout_rows, algorithm.align[role], f"{rollout}/{role}")
        done = algorithm.per_rollout(rollout_rows)
        by_group.setdefault((rollout_rows[0].group_id, role), []).append(done)
    return [row for rollouts in by_group.values() for row in algorithm.per_group(rollouts)]
