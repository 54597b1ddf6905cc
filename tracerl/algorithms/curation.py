"""Data curation: which finished groups, rollouts and advantages the trainer sees.

Each switch is a small step under one protocol (`CurationStep`: observe, apply, advantages,
group_size, metrics, state), off by default (`CurationConfig`), with its own metric.
`Curation` holds the steps that are on, in order; with none it changes nothing, so callers
never branch on whether curation is on.
- adaptive group size (DART): fewer rollouts for tasks that are always solved or always
  failed (a uniform group has no signal), more for tasks whose success is rare.
- replay (DART): remember successful rollouts of tasks that rarely succeed and put one back
  into a later all-fail group of that task, so that group has a success to learn from. The
  replayed rollout is the finished record read when it was first trained, spans included,
  so its rows carry the behaviour log-probs and versions that sampled them and the loss's
  importance correction accounts for its age.
- dynamic sampling (DAPO): drop groups whose rollouts with an outcome all got the same
  reward; GRPO gives them zero advantage, so they only dilute the batch. The rollout source
  tops the batch up with fresh tasks.
- conditional advantage (DDCA, HDPO): among a group's correct rollouts only, a bonus for the
  cheaper ones (fewer model calls or fewer sampled tokens), from the spans already read;
  incorrect rollouts untouched, so efficiency never competes with correctness.
High-entropy token selection (DART) lives in the loss: `LossConfig.entropy_top_q`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from tracerl.algorithms.config import CurationConfig, Secondary
from tracerl.algorithms.curation_step import CurationStep
from tracerl.algorithms.replay import Replay, ReplayState
from tracerl.algorithms.sizing import AdaptiveGroupSize, GroupSizeState
from tracerl.types import FinishedRollout, Group, Transition

__all__ = [
    "ConditionalAdvantage",
    "Curation",
    "CurationState",
    "CurationStep",
    "DynamicSampling",
    "Replay",
    "ReplayState",
    "conditional_bonuses",
    "rollout_cost",
    "zero_variance",
]


class CurationState(BaseModel):
    """What a checkpoint keeps of curation: the memory of each stateful step that is on."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    replay: ReplayState | None = None
    """The replay buffer."""
    group_sizes: GroupSizeState | None = None
    """The adaptive group size's recent outcomes."""


# ---------------------------------------------------------------- dynamic sampling (DAPO)


def zero_variance(group: Group) -> bool:
    """Whether the group carries no signal: its rollouts with an outcome all got the same
    final reward (None read as 0), or fewer than two have one. Step rewards are not read."""
    return len({f.reward for f in group.with_outcome()}) <= 1


class DynamicSampling(CurationStep):
    """Drop groups without reward variance; the source tops the batch up."""

    def __init__(self) -> None:
        self._dropped = 0

    def apply(self, groups: list[Group], batch: Sequence[Group]) -> list[Group]:
        kept = [g for g in groups if not zero_variance(g)]
        self._dropped += len(groups) - len(kept)
        return kept

    def metrics(self) -> dict[str, float]:
        out = {"curation/dropped_zero_variance": float(self._dropped)}
        self._dropped = 0
        return out


# ------------------------------------------------------------- adaptive group size (DART)


class AdaptiveSizes(CurationStep):
    """Each task's group size from its recent outcomes (rule: AdaptiveGroupSize)."""

    state_key = "group_sizes"

    def __init__(self, sizes: AdaptiveGroupSize) -> None:
        self.sizes = sizes

    def observe(self, group: Group) -> None:
        self.sizes.observe(group)

    def group_size(self, task_id: str, size: int) -> int:
        return self.sizes.size(task_id)

    def metrics(self) -> dict[str, float]:
        return self.sizes.metrics()

    def state(self) -> GroupSizeState:
        return self.sizes.state()

    def load_state(self, state: BaseModel) -> None:
        self.sizes.load_state(GroupSizeState.model_validate(state))


# ------------------------------------------------------- conditional advantage (DDCA/HDPO)


def rollout_cost(f: FinishedRollout, secondary: Secondary) -> float:
    """A rollout's cost from its spans: model calls, or sampled completion tokens."""
    if secondary == "calls":
        return float(len(f.spans))
    return float(sum(len(s.completion_ids) for s in f.spans))


def conditional_bonuses(
    rows: list[Transition],
    costs: dict[str, float],
    coef: float,
    success_threshold: float = 1.0,
    scale_by_pass_rate: bool = False,
) -> dict[str, float]:
    """Advantage bonus per correct rollout id, computed within each group.

    A rollout's return is the mean of its rows' rewards (as the algorithms take it); it is
    correct when that is >= success_threshold. Among a group's correct rollouts C with costs
    c: bonus_i = k * (mean(c) - c_i) / pstdev(c), k = coef (times the group's pass rate
    |C| / rollouts when scale_by_pass_rate). Groups with fewer than two correct rollouts or
    equal costs get none; incorrect rollouts never get one.
    """
    rewards: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        rewards.setdefault(row.group_id, {}).setdefault(row.rollout_id, []).append(row.reward)
    out: dict[str, float] = {}
    for by_rollout in rewards.values():
        correct = [
            rid for rid, rs in by_rollout.items() if statistics.fmean(rs) >= success_threshold
        ]
        if len(correct) < 2:
            continue
        c = [costs[rid] for rid in correct]
        std = statistics.pstdev(c)
        if std == 0:
            continue
        k = coef * (len(correct) / len(by_rollout) if scale_by_pass_rate else 1.0)
        mean = statistics.fmean(c)
        out.update({rid: k * (mean - ci) / std for rid, ci in zip(correct, c, strict=True)})
    return out


class ConditionalAdvantage(CurationStep):
    """Adds `conditional_bonuses` to each correct rollout's sampled tokens. Row weights (the
    algorithm's per-rollout normalisation) stay, so the bonus is weighted like the
    advantage it joins."""

    def __init__(
        self,
        coef: float,
        secondary: Secondary = "calls",
        success_threshold: float = 1.0,
        scale_by_pass_rate: bool = False,
    ) -> None:
        self.coef, self.secondary = coef, secondary
        self.threshold, self.scale_by_pass_rate = success_threshold, scale_by_pass_rate
        self._rows, self._adjusted = 0, 0
        self._bonuses: list[float] = []

    def advantages(self, groups: list[Group], rows: list[Transition]) -> list[Transition]:
        costs = {f.id: rollout_cost(f, self.secondary) for g in groups for f in g.rollouts}
        bonus = conditional_bonuses(rows, costs, self.coef, self.threshold, self.scale_by_pass_rate)
        self._rows += len(rows)
        self._adjusted += sum(r.rollout_id in bonus for r in rows)
        self._bonuses += [abs(b) for b in bonus.values()]
        return [_add_bonus(r, bonus[r.rollout_id]) if r.rollout_id in bonus else r for r in rows]

    def metrics(self) -> dict[str, float]:
        """The share of rows adjusted, and the bonus's mean absolute value over adjusted
        rollouts (its signed mean within a group is 0 by construction)."""
        out = {
            "curation/conditional_rows_fraction": self._adjusted / max(self._rows, 1),
            "curation/conditional_mean_abs_bonus": (
                statistics.fmean(self._bonuses) if self._bonuses else 0.0
            ),
        }
        self._rows, self._adjusted, self._bonuses = 0, 0, []
        return out


def _add_bonus(row: Transition, b: float) -> Transition:
    adv = [a + b * m for a, m in zip(row.advantages, row.loss_mask, strict=True)]
    return row.model_copy(update={"advantages": adv})


# ------------------------------------------------------------------------------ the list


class Curation:
    """The curation steps that are on, applied in order; an empty list changes nothing."""

    def __init__(self, steps: Sequence[CurationStep], group_size: int) -> None:
        self.steps = list(steps)
        self.base_group_size = group_size

    @classmethod
    def build(cls, cfg: CurationConfig, group_size: int, success_threshold: float) -> Curation:
        """The steps `cfg` turns on, in the order they must run: sizes and replay observe
        fresh outcomes, replay fills before dynamic sampling judges, bonuses come last."""
        thr = success_threshold
        steps: list[CurationStep] = []
        if cfg.adaptive_group_size:
            sizes = AdaptiveGroupSize(
                group_size, cfg.group_size_min, cfg.group_size_max, cfg.group_size_window,
                cfg.group_size_minority, thr,
            )  # fmt: skip
            steps.append(AdaptiveSizes(sizes))
        if cfg.replay:
            steps.append(Replay(cfg.replay_capacity, cfg.replay_max_success_rate, thr))
        if cfg.dynamic_sampling:
            steps.append(DynamicSampling())
        if cfg.conditional_coef > 0:
            steps.append(
                ConditionalAdvantage(
                    cfg.conditional_coef, cfg.secondary, thr, cfg.conditional_scale_by_pass_rate
                )
            )
        return cls(steps, group_size)

    def group_size(self, task_id: str) -> int:
        """Rollouts to issue for the task."""
        size = self.base_group_size
        for step in self.steps:
            size = step.group_size(task_id, size)
        return size

    def curate(
        self, groups: list[Group], batch: Sequence[Group] = ()
    ) -> tuple[list[Group], list[Group]]:
        """(kept, dropped) among complete `groups` joining `batch`. Every group's fresh
        outcomes are observed first (replayed rollouts never count as outcomes), then each
        step applies; the caller tops up for the dropped."""
        for group in groups:
            for step in self.steps:
                step.observe(group)
        kept = groups
        for step in self.steps:
            kept = step.apply(kept, batch)
        ids = {g.id for g in kept}
        return kept, [g for g in groups if g.id not in ids]

    def advantages(self, groups: list[Group], rows: list[Transition]) -> list[Transition]:
        """Credit-assigned rows after every step's adjustment."""
        for step in self.steps:
            rows = step.advantages(groups, rows)
        return rows

    def metrics(self) -> dict[str, float]:
        """Every step's counters since the last call."""
        return {k: v for step in self.steps for k, v in step.metrics().items()}

    def state(self) -> CurationState:
        """The memory of the stateful steps, for checkpoints."""
        parts = {s.state_key: s.state() for s in self.steps if s.state_key is not None}
        return CurationState.model_validate(parts)

    def load_state(self, state: CurationState) -> None:
        """Restore what `state()` returned (a step turned on since then starts empty)."""
        for step in self.steps:
            saved = getattr(state, step.state_key) if step.state_key else None
            if saved is not None:
                step.load_state(saved)
