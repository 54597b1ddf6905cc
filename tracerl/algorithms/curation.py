"""Data curation: which finished groups, rollouts and advantages the trainer sees.

Each switch is a small piece, off by default (`CurationConfig`), with its own metric:
- dynamic sampling (DAPO): drop groups whose finished rollouts all got the same reward;
  GRPO gives them zero advantage, so they only dilute the batch. The rollout source tops
  the batch up with fresh tasks.
- replay (DART): remember successful rollouts of tasks that rarely succeed and put one back
  into a later all-fail group of that task, so that group has a success to learn from. The
  replayed rollout is the stored record: its spans are still in the store, so its rows are
  rebuilt from them with the behaviour log-probs and versions that sampled them, and the
  loss's importance correction accounts for its age.
- adaptive group size (DART): fewer rollouts for tasks that are always solved or always
  failed (a uniform group has no signal), more for tasks whose success is rare.
- conditional advantage (DDCA, HDPO): among a group's correct rollouts only, a bonus for the
  cheaper ones (fewer model calls or fewer sampled tokens); incorrect rollouts untouched, so
  efficiency never competes with correctness.
High-entropy token selection (DART) lives in the loss: `LossConfig.entropy_top_q`.

`Curator` applies the switches in the order the pipeline needs them. `metrics()` on each
stateful piece returns its counters since the previous call, for per-step logging.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Collection
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from tracerl.algorithms.config import CurationConfig, Secondary
from tracerl.types import Rollout, RolloutStatus, Span, Transition

if TYPE_CHECKING:
    from tracerl.pipeline.sources import Group
    from tracerl.store import Store

__all__ = [
    "AdaptiveGroupSize",
    "CurationConfig",
    "Curator",
    "ReplayBuffer",
    "Secondary",
    "conditional_advantage",
    "conditional_bonuses",
    "drop_zero_variance",
    "finished",
    "rollout_cost",
    "rollout_costs",
    "zero_variance",
]


# Rollouts with an outcome to learn from; timed-out ones are not trained on (rows_for).
_OUTCOME = frozenset({RolloutStatus.succeeded, RolloutStatus.failed})


# ------------------------------------------------------------------------------ outcomes


def finished(group: Group) -> list[Rollout]:
    """The group's rollouts that have an outcome (succeeded or failed), in order."""
    return [r for r in group.rollouts if r.status in _OUTCOME]


def _success(rollout: Rollout, threshold: float) -> bool:
    return (rollout.reward or 0.0) >= threshold


# ---------------------------------------------------------------- dynamic sampling (DAPO)


def zero_variance(group: Group) -> bool:
    """Whether the group carries no signal: its finished rollouts all got the same final
    reward (None read as 0, as rows_for does), or fewer than two finished. Step rewards are
    not looked at."""
    return len({r.reward or 0.0 for r in finished(group)}) <= 1


def drop_zero_variance(groups: list[Group]) -> tuple[list[Group], list[Group]]:
    """Split groups into (kept, dropped): dropped are the zero-variance ones, order kept."""
    kept = [g for g in groups if not zero_variance(g)]
    dropped = [g for g in groups if zero_variance(g)]
    return kept, dropped


# ------------------------------------------------------------------------- replay (DART)


class ReplayState(BaseModel):
    """A ReplayBuffer's contents, as saved in a checkpoint."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    seen: dict[str, tuple[int, int]] = {}
    """Task id -> (finished rollouts observed, successes among them)."""
    stored: dict[str, list[Rollout]] = {}
    """Task id -> remembered successful rollouts, oldest first."""


class ReplayBuffer:
    """Successful rollouts per task, replayed into all-fail groups of rarely solved tasks."""

    def __init__(
        self, capacity: int = 4, max_success_rate: float = 0.25, success_threshold: float = 1.0
    ) -> None:
        self.capacity, self.max_success_rate = capacity, max_success_rate
        self.success_threshold = success_threshold
        self._seen: dict[str, tuple[int, int]] = {}
        self._stored: dict[str, list[Rollout]] = {}
        self._replayed = 0

    def observe(self, group: Group) -> None:
        """Count the group's finished outcomes and remember its successes."""
        task = group.task.id
        stored = self._stored.setdefault(task, [])
        n, s = self._seen.get(task, (0, 0))
        for r in finished(group):
            ok = _success(r, self.success_threshold)
            n, s = n + 1, s + ok
            if ok and all(x.id != r.id for x in stored):
                stored.append(r)
        self._seen[task] = (n, s)
        del stored[: -self.capacity]

    def success_rate(self, task_id: str) -> float | None:
        """Successes / finished rollouts observed for the task; None if none observed."""
        n, s = self._seen.get(task_id, (0, 0))
        return s / n if n else None

    def fill(self, group: Group, exclude: Collection[str] = ()) -> Group:
        """The group with its last finished (failed) rollout replaced by the newest stored
        success of its task, when the group has no success, the task's success rate is at
        most max_success_rate, and a stored success is neither in the group nor in
        `exclude`; otherwise the group unchanged."""
        done = finished(group)
        rate = self.success_rate(group.task.id)
        if not done or any(_success(r, self.success_threshold) for r in done):
            return group
        if rate is None or rate > self.max_success_rate:
            return group
        taken = {r.id for r in group.rollouts} | set(exclude)
        stored = self._stored.get(group.task.id, [])
        pick = next((r for r in reversed(stored) if r.id not in taken), None)
        if pick is None:
            return group
        victim = done[-1].id
        self._replayed += 1
        rollouts = [pick if r.id == victim else r for r in group.rollouts]
        return dataclasses.replace(group, rollouts=rollouts)

    def fill_batch(self, groups: list[Group]) -> list[Group]:
        """`fill` over one batch: no rollout ends up in the batch twice, whether replayed
        twice or replayed next to its own original group."""
        used = {r.id for g in groups for r in g.rollouts}
        out = []
        for group in groups:
            new = self.fill(group, used)
            used |= {r.id for r in new.rollouts}
            out.append(new)
        return out

    def metrics(self) -> dict[str, float]:
        """Rollouts replayed since the last call, and tasks holding a stored success."""
        out = {
            "curation/replayed": float(self._replayed),
            "curation/replay_tasks": float(sum(1 for v in self._stored.values() if v)),
        }
        self._replayed = 0
        return out

    def state(self) -> dict:
        """JSON-serialisable contents (see ReplayState)."""
        return ReplayState(seen=self._seen, stored=self._stored).model_dump(mode="json")

    def load_state(self, state: dict) -> None:
        """Restore what `state()` returned."""
        st = ReplayState.model_validate(state)
        self._seen = dict(st.seen)
        self._stored = {k: list(v) for k, v in st.stored.items()}


# ------------------------------------------------------------- adaptive group size (DART)


class GroupSizeState(BaseModel):
    """An AdaptiveGroupSize's memory, as saved in a checkpoint."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    outcomes: dict[str, list[int]] = {}
    """Task id -> its most recent finished outcomes (1 success, 0 failure), oldest first."""


class AdaptiveGroupSize:
    """Rollouts per task from the task's recent outcomes.

    With p the success rate over the task's last `window` finished outcomes:
      no outcome yet (unseen)  -> base
      p == 0 or p == 1         -> min_size (a uniform group has no signal: spend less)
      0 < p < 1                -> max(base, ceil(minority / min(p, 1 - p)))
    every result clamped to [min_size, max_size]. The mixed rule sizes the group so that it
    holds `minority` rollouts of the rarer outcome on average, never fewer than base: a task
    that succeeds 1 time in 10 gets 20 rollouts (before the clamp), an even one gets base.
    """

    def __init__(
        self,
        base: int,
        min_size: int = 2,
        max_size: int = 16,
        window: int = 32,
        minority: float = 2.0,
        success_threshold: float = 1.0,
    ) -> None:
        self.base, self.min_size, self.max_size = base, min_size, max_size
        self.window, self.minority = window, minority
        self.success_threshold = success_threshold
        self._outcomes: dict[str, deque[int]] = {}
        self._issued: list[int] = []

    def observe(self, group: Group) -> None:
        """Add the group's finished outcomes to its task's window."""
        window = self._outcomes.setdefault(group.task.id, deque(maxlen=self.window))
        window.extend(int(_success(r, self.success_threshold)) for r in finished(group))

    def size(self, task_id: str) -> int:
        """The group size to issue for the task now (see the class docstring)."""
        n = self._rule(self._outcomes.get(task_id))
        n = min(max(n, self.min_size), self.max_size)
        self._issued.append(n)
        return n

    def _rule(self, outcomes: deque[int] | None) -> int:
        if not outcomes:
            return self.base
        p = sum(outcomes) / len(outcomes)
        rare = min(p, 1.0 - p)
        if rare == 0:
            return self.min_size
        # The epsilon keeps float dust (2 / (1/6) = 12.000000000000002) from adding one.
        return max(self.base, math.ceil(self.minority / rare - 1e-9))

    def metrics(self) -> dict[str, float]:
        """Mean group size issued since the last call (absent when none was issued)."""
        out = {"curation/group_size_mean": statistics.fmean(self._issued)} if self._issued else {}
        self._issued = []
        return out

    def state(self) -> dict:
        """JSON-serialisable memory (see GroupSizeState)."""
        outcomes = {k: list(v) for k, v in self._outcomes.items()}
        return GroupSizeState(outcomes=outcomes).model_dump(mode="json")

    def load_state(self, state: dict) -> None:
        """Restore what `state()` returned."""
        st = GroupSizeState.model_validate(state)
        self._outcomes = {k: deque(v, maxlen=self.window) for k, v in st.outcomes.items()}


# ------------------------------------------------------- conditional advantage (DDCA/HDPO)


def rollout_cost(spans: list[Span], secondary: Secondary) -> float:
    """A rollout's cost from its spans: model calls, or sampled completion tokens."""
    if secondary == "calls":
        return float(len(spans))
    return float(sum(len(s.completion_ids) for s in spans))


def rollout_costs(store: Store, groups: list[Group], secondary: Secondary) -> dict[str, float]:
    """Cost of every finished rollout of the groups, keyed by rollout id."""
    return {r.id: rollout_cost(store.spans(r.id), secondary) for g in groups for r in finished(g)}


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


def conditional_advantage(
    rows: list[Transition],
    costs: dict[str, float],
    coef: float,
    success_threshold: float = 1.0,
    scale_by_pass_rate: bool = False,
) -> list[Transition]:
    """Rows with each correct rollout's `conditional_bonuses` added to the advantage of its
    sampled tokens. Row weights (the algorithm's per-rollout normalisation) are left as
    they are, so the bonus is weighted exactly like the advantage it joins."""
    bonus = conditional_bonuses(rows, costs, coef, success_threshold, scale_by_pass_rate)
    return [_add_bonus(r, bonus[r.rollout_id]) if r.rollout_id in bonus else r for r in rows]


def _add_bonus(row: Transition, b: float) -> Transition:
    adv = [a + b * m for a, m in zip(row.advantages, row.loss_mask, strict=True)]
    return row.model_copy(update={"advantages": adv})


# --------------------------------------------------------------------------------- curator


class Curator:
    """The switches of a CurationConfig, applied in the pipeline's order.

    Per batch of finished groups: `curate` (observe outcomes -> replay -> dynamic
    sampling), then after credit assignment `advantages` (conditional advantage); when
    issuing rollouts, `group_size`.
    """

    def __init__(self, cfg: CurationConfig, group_size: int) -> None:
        self.cfg = cfg
        self.base_group_size = group_size
        thr = cfg.success_threshold
        self.replay = (
            ReplayBuffer(cfg.replay_capacity, cfg.replay_max_success_rate, thr)
            if cfg.replay
            else None
        )
        self.sizes = (
            AdaptiveGroupSize(
                group_size,
                cfg.group_size_min,
                cfg.group_size_max,
                cfg.group_size_window,
                cfg.group_size_minority,
                thr,
            )
            if cfg.adaptive_group_size
            else None
        )
        self._dropped = 0
        self._rows = 0
        self._bonuses: list[float] = []
        self._adjusted = 0

    @property
    def needs_costs(self) -> bool:
        """Whether `advantages` uses rollout costs (conditional advantage on)."""
        return self.cfg.conditional_coef > 0

    def group_size(self, task_id: str) -> int:
        """Rollouts to issue for the task: adaptive when on, else the base size."""
        return self.sizes.size(task_id) if self.sizes else self.base_group_size

    def curate(self, groups: list[Group]) -> tuple[list[Group], list[Group]]:
        """(kept, dropped). Every group's fresh outcomes are observed first (replayed
        rollouts never count as outcomes), then replay fills all-fail groups, then dynamic
        sampling drops what still has no signal; the caller tops up for the dropped."""
        for g in groups:
            if self.sizes:
                self.sizes.observe(g)
            if self.replay:
                self.replay.observe(g)
        if self.replay:
            groups = self.replay.fill_batch(groups)
        if not self.cfg.dynamic_sampling:
            return groups, []
        kept, dropped = drop_zero_variance(groups)
        self._dropped += len(dropped)
        return kept, dropped

    def advantages(self, rows: list[Transition], costs: dict[str, float]) -> list[Transition]:
        """Credit-assigned rows with the conditional advantage added (when on)."""
        if not self.needs_costs:
            return rows
        cfg = self.cfg
        bonus = conditional_bonuses(
            rows, costs, cfg.conditional_coef, cfg.success_threshold,
            cfg.conditional_scale_by_pass_rate,
        )  # fmt: skip
        self._rows += len(rows)
        self._adjusted += sum(r.rollout_id in bonus for r in rows)
        self._bonuses += [abs(b) for b in bonus.values()]
        return [_add_bonus(r, bonus[r.rollout_id]) if r.rollout_id in bonus else r for r in rows]

    def metrics(self) -> dict[str, float]:
        """Counters of the switches that are on, since the last call. The conditional
        bonus is reported as its mean absolute value over adjusted rollouts: its signed mean
        within a group is 0 by construction."""
        out: dict[str, float] = {}
        if self.cfg.dynamic_sampling:
            out["curation/dropped_zero_variance"] = float(self._dropped)
        if self.replay:
            out |= self.replay.metrics()
        if self.sizes:
            out |= self.sizes.metrics()
        if self.needs_costs:
            out["curation/conditional_rows_fraction"] = self._adjusted / max(self._rows, 1)
            bonuses = self._bonuses
            out["curation/conditional_mean_abs_bonus"] = (
                statistics.fmean(bonuses) if bonuses else 0.0
            )
        self._dropped, self._rows, self._adjusted, self._bonuses = 0, 0, 0, []
        return out

    def state(self) -> dict:
        """JSON-serialisable state of the stateful switches, for checkpoints."""
        out = {}
        if self.replay:
            out["replay"] = self.replay.state()
        if self.sizes:
            out["group_sizes"] = self.sizes.state()
        return out

    def load_state(self, state: dict) -> None:
        """Restore what `state()` returned (switches turned on since start empty)."""
        if self.replay and "replay" in state:
            self.replay.load_state(state["replay"])
        if self.sizes and "group_sizes" in state:
            self.sizes.load_state(state["group_sizes"])
