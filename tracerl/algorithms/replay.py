"""Replay (DART): a stored success of a rarely solved task, put into its all-fail group.

The replayed rollout is the finished record read when it was first trained, spans
included, so its rows carry the behaviour log-probs and versions that sampled them and the
loss's importance correction accounts for its age. No rollout enters one batch twice.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from pydantic import BaseModel, ConfigDict

from tracerl.algorithms.curation_step import CurationStep
from tracerl.types import FinishedRollout, Group

__all__ = ["Replay", "ReplayState"]


class ReplayState(BaseModel):
    """A Replay step's memory, as saved in a checkpoint."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    seen: dict[str, tuple[int, int]] = {}
    """Task id -> (rollouts with an outcome observed, successes among them)."""
    stored: dict[str, list[FinishedRollout]] = {}
    """Task id -> remembered successful rollouts, oldest first."""


class Replay(CurationStep):
    """Successful rollouts per task, replayed into all-fail groups of rarely solved tasks."""

    state_key = "replay"

    def __init__(
        self, capacity: int = 4, max_success_rate: float = 0.25, success_threshold: float = 1.0
    ) -> None:
        self.capacity, self.max_success_rate = capacity, max_success_rate
        self.threshold = success_threshold
        self._mem = ReplayState()
        self._replayed = 0

    def observe(self, group: Group) -> None:
        """Count the group's outcomes and remember its successes."""
        task = group.task.id
        stored = self._mem.stored.setdefault(task, [])
        n, s = self._mem.seen.get(task, (0, 0))
        for f in group.with_outcome():
            ok = f.success(self.threshold)
            n, s = n + 1, s + ok
            if ok and all(x.id != f.id for x in stored):
                stored.append(f)
        self._mem.seen[task] = (n, s)
        del stored[: -self.capacity]

    def success_rate(self, task_id: str) -> float | None:
        """Successes / rollouts with an outcome observed for the task; None if none."""
        n, s = self._mem.seen.get(task_id, (0, 0))
        return s / n if n else None

    def fill(self, group: Group, exclude: Collection[str] = ()) -> Group:
        """The group with its last (failed) rollout with an outcome replaced by the newest
        stored success of its task, when the group has no success, the task's success rate
        is at most max_success_rate, and a stored success is neither in the group nor in
        `exclude`; otherwise the group unchanged."""
        done = group.with_outcome()
        rate = self.success_rate(group.task.id)
        if not done or any(f.success(self.threshold) for f in done):
            return group
        if rate is None or rate > self.max_success_rate:
            return group
        taken = {f.id for f in group.rollouts} | set(exclude)
        stored = self._mem.stored.get(group.task.id, [])
        pick = next((f for f in reversed(stored) if f.id not in taken), None)
        if pick is None:
            return group
        victim = done[-1].id
        self._replayed += 1
        rollouts = [pick if f.id == victim else f for f in group.rollouts]
        return group.model_copy(update={"rollouts": rollouts})

    def apply(self, groups: list[Group], batch: Sequence[Group]) -> list[Group]:
        """`fill` over new groups: no rollout ends up in the batch twice, whether replayed
        twice or replayed next to its own original group, in this call or an earlier one
        that built the same batch."""
        used = {f.id for g in [*batch, *groups] for f in g.rollouts}
        out = []
        for group in groups:
            new = self.fill(group, used)
            used |= {f.id for f in new.rollouts}
            out.append(new)
        return out

    def metrics(self) -> dict[str, float]:
        """Rollouts replayed since the last call, and tasks holding a stored success."""
        out = {
            "curation/replayed": float(self._replayed),
            "curation/replay_tasks": float(sum(1 for v in self._mem.stored.values() if v)),
        }
        self._replayed = 0
        return out

    def state(self) -> ReplayState:
        return self._mem.model_copy(deep=True)

    def load_state(self, state: BaseModel) -> None:
        self._mem = ReplayState.model_validate(state).model_copy(deep=True)
