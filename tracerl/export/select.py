"""Recorded traces -> training rows, exactly as RL builds them, for SFT and export.

Each finished rollout that passes the filter has the calls of its last attempt merged per
role by `spans_to_transitions` (the same function the RL step uses), so a row's ids are the
ids the gateway recorded and its loss mask covers exactly the sampled tokens. Nothing is
re-tokenized. Calls of a role the filter leaves out are not read; tokens sampled by a
policy version it leaves out stay in the row as context with mask 0.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.export.filter import TraceFilter
from tracerl.noise import NOISE_REWARD
from tracerl.store import Store
from tracerl.types import FINISHED, Reward, Rollout, Span, Task, Transition

__all__ = ["TraceRow", "select_rows", "store_path"]


class TraceRow(BaseModel):
    """One training row of one recorded rollout, with what it came from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rollout: Rollout
    """The rollout (status, final reward, answer)."""
    task: Task
    """The task it attempted."""
    spans: list[Span]
    """The calls merged into the row, in call order; the last holds the whole conversation."""
    row: Transition
    """input_ids and loss_mask (1 on sampled tokens only), as the RL step would build them."""
    noise: float
    """Tool perturbations recorded for the rollout (0 without noise)."""


def store_path(target: str | Path) -> Path:
    """A store file, or a run directory holding traces.db (FileNotFoundError otherwise)."""
    path = Path(target)
    if path.is_dir():
        path = path / "traces.db"
    if not path.is_file():
        raise FileNotFoundError(f"no store at {target} (a traces.db file or a run directory)")
    return path


def _noise(rewards: list[Reward]) -> float:
    return sum(r.value for r in rewards if r.name == NOISE_REWARD)


def _rows(spans: list[Span], rollout: Rollout, rewards: list[Reward]) -> list[Transition]:
    """The rollout's rows with the returns the RL step would credit them."""
    scored = [r for r in rewards if r.name != NOISE_REWARD]
    steps = {r.span_seq: r.value for r in scored if r.span_seq is not None}
    roles = {r.role: r.value for r in scored if r.role is not None}
    return spans_to_transitions(
        spans,
        rollout.reward or 0.0,
        steps or None,
        roles or None,
        group_id=rollout.group_id or "",
        task_id=rollout.task_id,
        answer=rollout.answer,
    )


def _mask_versions(row: Transition, flt: TraceFilter) -> Transition:
    """The row with tokens of versions the filter leaves out turned into context."""
    pairs = zip(row.loss_mask, row.versions, strict=True)
    mask = [m if m and flt.keeps_version(v) else 0 for m, v in pairs]
    return row if mask == row.loss_mask else row.model_copy(update={"loss_mask": mask})


def select_rows(store: Store, flt: TraceFilter) -> list[TraceRow]:
    """Rows of every finished rollout passing `flt`, rollouts oldest first; rows left with
    no sampled token to train on are dropped."""
    tasks = {t.id: t for t in store.tasks()}
    finished = [r for status in FINISHED for r in store.rollouts(status=status)]
    out = []
    for rollout in sorted(finished, key=lambda r: (r.created_at, r.id)):
        task = tasks[rollout.task_id]
        rewards = store.rewards(rollout.id, rollout.attempt)
        values: dict[str, str | float | int | None] = {
            "reward": rollout.reward,
            "noise": _noise(rewards),
            "status": rollout.status.value,
            "split": task.split,
            "task": task.id,
        }
        if not flt.keeps_rollout(values):
            continue
        spans = [s for s in store.spans(rollout.id, rollout.attempt) if flt.keeps_role(s.role)]
        by_id = {s.id: s for s in spans}
        for row in _rows(spans, rollout, rewards):
            row = _mask_versions(row, flt)
            if any(row.loss_mask):
                mine = [by_id[i] for i in row.span_ids]
                out.append(TraceRow(rollout=rollout, task=task, spans=mine, row=row,
                                    noise=float(values["noise"] or 0)))  # fmt: skip
    return out
