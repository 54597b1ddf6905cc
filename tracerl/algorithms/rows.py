"""Finished groups -> credit-assigned training rows: the pure code of one training step.

Everything here works on records already read from the store (`Group` of
`FinishedRollout`), so a step reads each finished rollout once and the transforms are
tested without a store.
"""

from __future__ import annotations

from tracerl.algorithms.advantages import Algorithm, compute_advantages
from tracerl.algorithms.curation import Curation
from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.types import UNASSISTED, FinishedRollout, Group, Transition, bounded_reward

__all__ = ["distilled", "rollout_rows", "rows_for"]


def rollout_rows(f: FinishedRollout, group: Group, unassisted: bool = False) -> list[Transition]:
    """One rollout's rows with their returns: the final reward, a role's own reward in place
    of it for that role, a step reward added to the row holding that call (each read
    through `bounded_reward`, as `f.reward` is, so curation's statistics stay finite).
    `unassisted`: its distilled calls' rows instead (transitions.py)."""
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
        unassisted=unassisted,
    )


def rows_for(
    groups: list[Group], algorithm: Algorithm, curation: Curation | None = None
) -> list[Transition]:
    """Rows of every rollout with an outcome, advantages written per (group, role), then
    curation's adjustments (conditional advantage); then the distilled rows (`distilled`)."""
    rows = [row for g in groups for f in g.with_outcome() for row in rollout_rows(f, g)]
    rows = compute_advantages(algorithm, rows)
    rows = curation.advantages(groups, rows) if curation is not None else rows
    return rows + distilled(groups, rows)


def distilled(groups: list[Group], rows: list[Transition]) -> list[Transition]:
    """The replies an asset curriculum distills (calls that recorded their prompt without
    the asset), once more, on that prompt, with the advantage their rollout's rows earned,
    when positive: a success under the asset is what to say without it, while a failure
    under it says nothing of what the policy says without it (taught against, its tag
    tokens were pushed down in every context: measured on SmolLM2, README). The rows as
    sampled still train under the asset, so it keeps improving what there is to distill."""
    earned: dict[tuple[str, str], float] = {}
    for r in rows:
        a = max((x for x, m in zip(r.advantages, r.loss_mask, strict=True) if m), default=0.0)
        key = (r.rollout_id, r.role)
        earned[key] = max(earned.get(key, a), a)
    out = []
    for g in groups:
        for f in g.with_outcome():
            if not any(UNASSISTED in s.response for s in f.spans):
                continue  # most rollouts (every one of a run without a curriculum)
            for row in rollout_rows(f, g, unassisted=True):
                a = earned.get((row.rollout_id, row.role), 0.0)
                if a > 0:
                    out.append(
                        row.model_copy(update={"advantages": [a * m for m in row.loss_mask]})
                    )
    return out
