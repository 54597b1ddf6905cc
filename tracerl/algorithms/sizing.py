"""Adaptive group size (DART): how many rollouts to issue for a task, from its outcomes."""

from __future__ import annotations

import math
import statistics
from collections import deque

from pydantic import BaseModel, ConfigDict

from tracerl.types import Group

__all__ = ["AdaptiveGroupSize", "GroupSizeState"]


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
        window.extend(int(f.success(self.success_threshold)) for f in group.with_outcome())

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

    def state(self) -> GroupSizeState:
        """The memory, as a record (see GroupSizeState)."""
        return GroupSizeState(outcomes={k: list(v) for k, v in self._outcomes.items()})

    def load_state(self, state: GroupSizeState) -> None:
        """Restore what `state()` returned."""
        self._outcomes = {k: deque(v, maxlen=self.window) for k, v in state.outcomes.items()}
