"""Retention: shrink a store without touching what a run still needs.

A store only grows: every attempt's spans stay, token ids included. `prune` deletes old
finished rollouts with their spans and rewards, then gives the space back (VACUUM). It
never deletes a rollout that is queued or running (the status is checked inside the delete
itself, so a runner finishing one meanwhile changes nothing), nor one in `keep_ids`.

What a run still needs (`needed_by_run`) is read from its latest checkpoint, the state a
resume starts from: the rollouts of groups its source has not consumed yet (they are
trained after the resume) and the ones its replay buffer holds. Tasks and policy
versions are small and are kept.
"""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
from pydantic import BaseModel, ConfigDict

from tracerl.store import Store
from tracerl.store.sqlite import SqliteStore
from tracerl.types import FINISHED

if TYPE_CHECKING:  # psycopg is imported only when a PostgreSQL store is pruned
    from tracerl.store.postgres import PostgresStore

__all__ = ["PruneCounts", "integrity_ok", "needed_by_run", "newest_finished", "prune"]

_FINISHED = tuple(sorted(s.value for s in FINISHED))
_SYNC_GROUP = re.compile(r"/step(\d+)/")
_ASYNC_GROUP = re.compile(r"/g(\d+)-")


class PruneCounts(BaseModel):
    """What one prune removed."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", frozen=True)

    rollouts: int
    """Rollouts deleted."""
    spans: int
    """Spans deleted (every attempt's)."""
    rewards: int
    """Rewards deleted (every attempt's)."""
    bytes_before: int
    """The SQLite file's size before (0 for PostgreSQL)."""
    bytes_after: int
    """The SQLite file's size after VACUUM (0 for PostgreSQL)."""


def needed_by_run(store: Store, run_dir: str | Path) -> set[str]:
    """Rollout ids the run at `run_dir` needs to resume: those of groups its latest
    checkpoint's source has not consumed, and those its replay buffer holds (none
    before the first checkpoint: then every group of the run is pending)."""
    run = Path(run_dir)
    name = json.loads((run / "config.json").read_text())["name"]
    state = _latest_state(run)
    source = state.get("source", {})
    consumed = set(source.get("consumed", []))
    below = int(source.get("consumed_below", 0))
    step = int(state.get("step", 0))
    needed = set()
    for r in store.rollouts():
        gid = r.group_id or ""
        if gid.startswith(f"{name}/") and _pending(gid, step, below, consumed):
            needed.add(r.id)
    replay = (state.get("curation") or {}).get("replay") or {}
    for kept in replay.get("stored", {}).values():
        needed.update(f["rollout"]["id"] for f in kept)
    return needed


def _latest_state(run: Path) -> dict:
    """The latest checkpoint's pipeline.json as JSON ({} without a checkpoint)."""
    pointer = run / "checkpoints" / "latest"
    if not pointer.exists():
        return {}
    path = run / "checkpoints" / pointer.read_text().strip() / "pipeline.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _pending(gid: str, step: int, below: int, consumed: set[int]) -> bool:
    """Whether a training group is not consumed yet: a sync group of step `step` or
    later, an async group not below `below` nor in `consumed`. Other groups of the run
    (pre-flight, held-out evaluations) are never trained on."""
    if m := _SYNC_GROUP.search(gid):
        return int(m.group(1)) >= step
    if m := _ASYNC_GROUP.search(gid):
        index = int(m.group(1))
        return index >= below and index not in consumed
    return False


def newest_finished(store: Store, n: int) -> set[str]:
    """The ids of the `n` most recently finished rollouts."""
    done = [r for r in store.rollouts() if r.status in FINISHED]
    done.sort(key=lambda r: r.finished_at or 0.0)
    return {r.id for r in done[len(done) - n :]} if n > 0 else set()


def prune(store: Store, keep_ids: set[str], before_time: float) -> PruneCounts:
    """Delete every finished rollout that finished before `before_time` (Unix seconds)
    and is not in `keep_ids`, with its spans and rewards of every attempt; then VACUUM."""
    if isinstance(store, SqliteStore):
        return _prune_sqlite(store, keep_ids, before_time)
    if type(store).__name__ == "PostgresStore":
        from tracerl.store.postgres import PostgresStore

        assert isinstance(store, PostgresStore)
        return _prune_postgres(store, keep_ids, before_time)
    raise TypeError(f"prune needs a SQLite or PostgreSQL store, not {type(store).__name__}")


_DOOMED = (
    "CREATE TEMP TABLE doomed AS SELECT id FROM rollouts WHERE status IN ({marks}) "
    "AND finished_at < {mark} AND id NOT IN (SELECT value FROM json_each({mark}))"
)
_DELETES = (
    "DELETE FROM spans WHERE rollout_id IN (SELECT id FROM doomed)",
    "DELETE FROM rewards WHERE rollout_id IN (SELECT id FROM doomed)",
    "DELETE FROM rollouts WHERE id IN (SELECT id FROM doomed)",
)


def _prune_sqlite(store: SqliteStore, keep_ids: set[str], before_time: float) -> PruneCounts:
    before = _file_bytes(store.path)
    keep = orjson.dumps(sorted(keep_ids)).decode()
    # The store's own connection and lock (its module doc: nobody else touches it); one
    # IMMEDIATE transaction, so the set chosen is the set deleted.
    with store._tx() as db:
        db.execute("DROP TABLE IF EXISTS temp.doomed")
        db.execute(
            _DOOMED.format(marks=", ".join("?" * len(_FINISHED)), mark="?"),
            (*_FINISHED, before_time, keep),
        )
        spans, rewards, rollouts = (db.execute(sql).rowcount for sql in _DELETES)
        db.execute("DROP TABLE temp.doomed")
    with store._read() as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # so VACUUM's result is the file's
        db.execute("VACUUM")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    after = _file_bytes(store.path)
    return PruneCounts(
        rollouts=rollouts, spans=spans, rewards=rewards, bytes_before=before, bytes_after=after
    )


def _file_bytes(path: str) -> int:
    """The database's bytes on disk, its WAL included (0 in memory)."""
    files = [Path(path), Path(path + "-wal")]
    return sum(p.stat().st_size for p in files if p.exists())


def _prune_postgres(store: PostgresStore, keep_ids: set[str], before_time: float) -> PruneCounts:
    with store._tx() as cur:
        cur.execute(
            "CREATE TEMP TABLE doomed ON COMMIT DROP AS SELECT id FROM rollouts "
            "WHERE status = ANY(%s) AND finished_at < %s AND NOT (id = ANY(%s))",
            (list(_FINISHED), before_time, sorted(keep_ids)),
        )
        spans, rewards, rollouts = (cur.execute(sql).rowcount for sql in _DELETES)
    return PruneCounts(rollouts=rollouts, spans=spans, rewards=rewards, bytes_before=0,
                       bytes_after=0)  # fmt: skip


def integrity_ok(path: str | Path) -> bool:
    """Whether SQLite's integrity_check passes on the file (read through a new connection)."""
    db = sqlite3.connect(str(path))
    try:
        return db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        db.close()
