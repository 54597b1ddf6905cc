"""Read-only SQL over a run's traces.db, for pages that must stay fast on big stores.

The store's own API reads whole lists; a page wants one filtered page of rollouts, its
total, and a few aggregates. Every query here runs on its own read-only connection
(`mode=ro`, so the dashboard can never write a training run's store; WAL lets it read
while the run writes), pages with LIMIT/OFFSET, and filters on indexed columns: rowid order,
status, group id (a prefix is an index range), task id, and per-rollout span lookups
through the (rollout_id, attempt, seq) index. Rows decode with the store's own codecs.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from tracerl.store.schema import (
    REWARD_COLS,
    ROLLOUT_COLS,
    SELECT_ROLLOUT,
    SPAN_COLS,
    reward_from_row,
    rollout_from_row,
    span_from_row,
    task_from_row,
)
from tracerl.types import Reward, Rollout, RolloutStatus, Span, Task

__all__ = ["Health", "Page", "RolloutFilter", "RolloutRow", "RunStore", "VersionView"]


class RolloutFilter(BaseModel):
    """Which rollouts a table page shows (every filter optional; all given must hold)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    status: RolloutStatus | None = None
    """Lifecycle state."""
    task: str | None = Field(default=None, max_length=500)
    """Task id (exact)."""
    group: str | None = Field(default=None, max_length=500)
    """Group id, or its start (e.g. 'demo/step3/' for step 3's groups of a sync run)."""
    step: int | None = Field(default=None, ge=0, lt=2**31)
    """Rollouts trained at this step (from the run's trained.jsonl)."""
    version: int | None = Field(default=None, ge=-1, lt=2**31)
    """Some call sampled by this policy version."""
    role: str | None = Field(default=None, max_length=200)
    """Some call made as this role (the `model` the agent asked for)."""
    reward_min: float | None = None
    """Final reward at least this."""
    reward_max: float | None = None
    """Final reward at most this."""
    q: str | None = Field(default=None, max_length=200)
    """Text searched in the id, task id, group id, answer and error."""
    order: Literal["newest", "oldest", "reward", "-reward"] = "newest"
    """Row order: by creation, or by final reward (high first, or low first)."""
    limit: int = Field(default=50, ge=1, le=500)
    """Rows per page."""
    offset: int = Field(default=0, ge=0, le=10**9)
    """Rows skipped."""


class RolloutRow(BaseModel):
    """One table row: the rollout's record and what its calls add."""

    rollout: Rollout
    """The store's record."""
    calls: int
    """Model calls of its current attempt."""
    roles: list[str]
    """Roles among those calls."""
    version_min: int | None
    """Oldest policy version among those calls."""
    version_max: int | None
    """Newest policy version among those calls."""
    completion_tokens: int
    """Tokens sampled over those calls."""
    step: int | None = None
    """The training step that trained on it (None: not trained, or not yet)."""


class Page(BaseModel):
    """One page of the rollouts table."""

    total: int
    """Rollouts matching the filter, over all pages."""
    offset: int
    """Rows skipped before this page."""
    rows: list[RolloutRow]
    """This page's rows."""
    query_ms: float
    """Time the queries took."""


class VersionView(BaseModel):
    """The newest published version of one role."""

    role: str
    """The role (model name)."""
    version: int
    """Its newest version (= training steps done)."""
    path: str
    """The checkpoint holding those weights; "" when that step was not checkpointed."""
    created_at: float
    """When it was published."""


class Health(BaseModel):
    """What the engine and runners are doing, from the store."""

    counts: dict[str, int]
    """Rollouts by status: queued is the queue depth, running what runners hold."""
    leases_expiring: int
    """Running rollouts whose lease ends within `soon_s` (a runner may be stuck)."""
    leases_expired: int
    """Running rollouts whose lease has already ended (re-queued at the next claim)."""
    finished_last_min: int
    """Rollouts finished in the last 60 s (among the newest _RECENT_ROWS)."""
    calls_last_min: int
    """Model calls recorded in the last 60 s (among the newest _RECENT_ROWS)."""
    tokens_last_min: int
    """Tokens sampled in the last 60 s."""
    versions: list[VersionView]
    """The newest published version of each role."""
    versions_published: int
    """Versions published in all, over all roles."""


def _like(text: str) -> str:
    """A LIKE pattern matching `text` anywhere, its wildcards taken literally."""
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _where(f: RolloutFilter, step_ids: list[str] | None) -> tuple[str, list[object]]:
    """The WHERE clause (or '') and its arguments for a filter."""
    where: list[str] = []
    args: list[object] = []
    if f.status is not None:
        where.append("r.status = ?")
        args.append(f.status.value)
    if f.task is not None:
        where.append("r.task_id = ?")
        args.append(f.task)
    if f.group:
        # A prefix as a range, so the group index serves it (LIKE would scan).
        where.append("r.group_id >= ? AND r.group_id < ?")
        args += [f.group, f.group + "\U0010ffff"]
    if step_ids is not None:
        where.append("r.id IN (SELECT value FROM json_each(?))")
        args.append(orjson.dumps(step_ids).decode())
    for col, val in (("policy_version", f.version), ("role", f.role)):
        if val is not None:
            where.append(
                "EXISTS (SELECT 1 FROM spans s WHERE s.rollout_id = r.id "
                f"AND s.attempt = r.attempt AND s.{col} = ?)"
            )
            args.append(val)
    if f.reward_min is not None:
        where.append("r.reward >= ?")
        args.append(f.reward_min)
    if f.reward_max is not None:
        where.append("r.reward <= ?")
        args.append(f.reward_max)
    if f.q:
        cols = ("r.id", "r.task_id", "r.group_id", "r.answer", "r.error")
        where.append("(" + " OR ".join(f"{c} LIKE ? ESCAPE '\\'" for c in cols) + ")")
        args += [_like(f.q)] * len(cols)
    return (" WHERE " + " AND ".join(where)) if where else "", args


_ORDER = {
    "newest": "r.rowid DESC",
    "oldest": "r.rowid",
    "reward": "r.reward IS NULL, r.reward DESC, r.rowid DESC",
    "-reward": "r.reward IS NULL, r.reward, r.rowid DESC",
}


class RunStore:
    """Read-only queries over one traces.db (a connection per call: threads never share)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        if not self.path.exists():
            raise FileNotFoundError(f"no store at {self.path}")
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=10.0)
        try:
            yield db
        finally:
            db.close()

    def page(self, f: RolloutFilter, steps: dict[str, int]) -> Page:
        """One page of rollouts; `steps` maps a trained rollout's id to its step."""
        started = time.perf_counter()
        step_ids = None
        if f.step is not None:
            step_ids = [rid for rid, s in steps.items() if s == f.step]
        where, args = _where(f, step_ids)
        cols = ", ".join(f"r.{c}" for c in ROLLOUT_COLS)
        sql = f"SELECT {cols} FROM rollouts r{where} ORDER BY {_ORDER[f.order]} LIMIT ? OFFSET ?"
        with self._db() as db:
            total = db.execute(f"SELECT COUNT(*) FROM rollouts r{where}", args).fetchone()[0]
            found = [rollout_from_row(r) for r in db.execute(sql, [*args, f.limit, f.offset])]
            calls = self._calls(db, found)
        rows = [
            RolloutRow(rollout=r, step=steps.get(r.id), **calls.get(r.id, _NO_CALLS)) for r in found
        ]
        ms = (time.perf_counter() - started) * 1000
        return Page(total=total, offset=f.offset, rows=rows, query_ms=ms)

    def _calls(self, db: sqlite3.Connection, found: list[Rollout]) -> dict[str, dict]:
        """Per rollout of a page: its current attempt's calls, roles, versions, tokens."""
        if not found:
            return {}
        pairs = orjson.dumps([[r.id, r.attempt] for r in found]).decode()
        rows = db.execute(
            "SELECT s.rollout_id, COUNT(*), GROUP_CONCAT(DISTINCT s.role), "
            "MIN(s.policy_version), MAX(s.policy_version), SUM(LENGTH(s.completion_ids)) / 4 "
            "FROM json_each(?) j JOIN spans s ON s.rollout_id = j.value ->> 0 "
            "AND s.attempt = j.value ->> 1 GROUP BY s.rollout_id",
            (pairs,),
        )
        return {
            rid: {
                "calls": n,
                "roles": sorted((roles or "").split(",")) if roles else [],
                "version_min": vmin,
                "version_max": vmax,
                "completion_tokens": tokens or 0,
            }  # fmt: skip
            for rid, n, roles, vmin, vmax, tokens in rows
        }

    def rollout(self, rollout_id: str) -> tuple[Rollout, Task | None, list[Span], list[Reward]]:
        """One rollout, its task, and its current attempt's spans and rewards (KeyError if
        there is no such rollout)."""
        with self._db() as db:
            row = db.execute(f"{SELECT_ROLLOUT} WHERE id = ?", (rollout_id,)).fetchone()
            if row is None:
                raise KeyError(rollout_id)
            r = rollout_from_row(row)
            task_row = db.execute("SELECT * FROM tasks WHERE id = ?", (r.task_id,)).fetchone()
            spans = db.execute(
                f"SELECT {', '.join(SPAN_COLS)} FROM spans WHERE rollout_id = ? AND attempt = ? "
                "ORDER BY seq",
                (r.id, r.attempt),
            ).fetchall()
            rewards = db.execute(
                f"SELECT {', '.join(REWARD_COLS)} FROM rewards WHERE rollout_id = ? "
                "AND attempt = ? ORDER BY rowid",
                (r.id, r.attempt),
            ).fetchall()
        task = task_from_row(task_row) if task_row else None
        return r, task, [span_from_row(s) for s in spans], [reward_from_row(w) for w in rewards]

    def group(self, group_id: str) -> list[Rollout]:
        """The rollouts of one group, in issue order."""
        with self._db() as db:
            rows = db.execute(
                f"{SELECT_ROLLOUT} WHERE group_id = ? ORDER BY rowid", (group_id,)
            ).fetchall()
        return [rollout_from_row(r) for r in rows]

    def health(self, soon_s: float = 10.0) -> Health:
        """Queue depth, leases, recent throughput and published versions."""
        now = time.time()
        with self._db() as db:
            counts = dict(db.execute("SELECT status, COUNT(*) FROM rollouts GROUP BY status"))
            expiring, expired = db.execute(
                "SELECT COALESCE(SUM(lease_expires_at BETWEEN ?1 AND ?2), 0), "
                "COALESCE(SUM(lease_expires_at < ?1), 0) FROM rollouts WHERE status = 'running'",
                (now, now + soon_s),
            ).fetchone()
            # Neither finished_at nor spans.created_at has an index: only the newest rows
            # (rowid order) are read, which holds the last minute's unless it was huge.
            finished = db.execute(
                "SELECT COUNT(*) FROM rollouts WHERE rowid > (SELECT MAX(rowid) FROM rollouts) "
                "- ?2 AND finished_at >= ?1",
                (now - 60, _RECENT_ROWS),
            ).fetchone()[0]
            calls, tokens = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(completion_ids)) / 4, 0) FROM spans "
                "WHERE rowid > (SELECT COALESCE(MAX(rowid), 0) FROM spans) - ?2 "
                "AND created_at >= ?1",
                (now - 60, _RECENT_ROWS),
            ).fetchone()
            versions = db.execute(
                "SELECT role, MAX(version), path, created_at FROM versions GROUP BY role"
            ).fetchall()
            published = db.execute("SELECT COUNT(*) FROM versions").fetchone()[0]
        return Health(
            counts={s.value: counts.get(s.value, 0) for s in RolloutStatus},
            leases_expiring=expiring, leases_expired=expired, finished_last_min=finished,
            calls_last_min=calls, tokens_last_min=tokens, versions_published=published,
            versions=[
                VersionView(role=r, version=v, path=p, created_at=t) for r, v, p, t in versions
            ],
        )  # fmt: skip


_RECENT_ROWS = 5_000
"""Newest rollouts and spans the last minute's rates are counted from: the health panel
polls every second, so it reads a bounded tail, not the whole store."""

_NO_CALLS = {"calls": 0, "roles": [], "version_min": None, "version_max": None,
             "completion_tokens": 0}  # fmt: skip
