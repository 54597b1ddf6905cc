"""Finished groups -> credit-assigned training rows: the pure code of one training step.

Everything here works on records already read from the store (`Group` of
`FinishedRollout`), so a step reads each finished rollout once and the transforms are
tested without a store.
"""

from __future__ import annotations

from tracerl.algorithms.advantages import Algorithm, compute_advantages
from tracerl.algorithms.curation import Curation
from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.types import FinishedRollout, Group, Transition, bounded_reward

__all__ = ["rollout_rows", "rows_for"]


def rollout_rows(f: FinishedRollout, group: Group) -> list[Transition]:
    """One rollout's rows with their returns: the final reward, a role's own reward in place
    of it for that role, a step reward added to the row holding that call (each read
    through `bounded_reward`, as `f.reward` is, so curation's statistics stay finite)."""
    steps = {w.span_seq: bounded_reward(w.value) for w in f.rewards if w.span_seq is not None}
    # A role rewarded twice keeps the last.
    by_role = {w.role: bounded_reward(w.value) for w in f.rewards if w.role is not None}
    return spans_to_transitions(
        f.spans,
        f.reward,
        steps or None,
        by_role or None,
        group_id=group.id,
        task_id=group.task.id,
        answer=f.rollout.answer,
    )


def rows_for(
    groups: list[Group], algorithm: Algorithm, curation: Curation | None = None
) -> list[Transition]:
    """Rows of every rollout with an outcome, advantages written per (group, role), then
    curation's adjustments (conditional advantage)."""
    rows = [row for g in groups for f in g.with_outcome() for row in rollout_rows(f, g)]
    rows = compute_advantages(algorithm, rows)
    return curation.advantages(groups, rows) if curation is not None else rows
