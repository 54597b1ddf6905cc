"""The embedded store: SQLite in one file (WAL), or in memory for tests.

One connection guarded by one lock serves every thread (the gateway's event loop and the
runners' workers); each write is one short IMMEDIATE transaction, so a claim is atomic and
two claimers never get the same rollout. Every rollout state change goes through
`_transition`, which refuses anything not in VALID_TRANSITIONS. Token ids and log-probs are
stored packed (see packing.py), messages and responses as JSON text.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from tracerl.store import Conflict, InvalidTransition, LeaseLost, NotFound, Store
from tracerl.store.packing import pack_floats, pack_ids, unpack_floats, unpack_ids
from tracerl.types import (
    FINISHED,
    VALID_TRANSITIONS,
    PolicyVersion,
    Reward,
    Rollout,
    RolloutStatus,
    Span,
    Task,
)

__all__ = ["SqliteStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY, input TEXT NOT NULL, answer TEXT NOT NULL, split TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS tasks_split ON tasks (split);
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY, task_id TEXT NOT NULL REFERENCES tasks (id), status TEXT NOT NULL,
    attempt INTEGER NOT NULL, max_attempts INTEGER NOT NULL, group_id TEXT, runner_id TEXT,
    lease_expires_at REAL, created_at REAL NOT NULL, started_at REAL, finished_at REAL,
    answer TEXT, reward REAL, error TEXT);
CREATE INDEX IF NOT EXISTS rollouts_claim ON rollouts (status, created_at);
CREATE INDEX IF NOT EXISTS rollouts_lease ON rollouts (status, lease_expires_at);
CREATE INDEX IF NOT EXISTS rollouts_group ON rollouts (group_id);
CREATE INDEX IF NOT EXISTS rollouts_task ON rollouts (task_id);
CREATE TABLE IF NOT EXISTS spans (
    id TEXT PRIMARY KEY, rollout_id TEXT NOT NULL REFERENCES rollouts (id),
    attempt INTEGER NOT NULL, seq INTEGER NOT NULL, role TEXT NOT NULL,
    policy_version INTEGER NOT NULL, prompt_ids BLOB NOT NULL, completion_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL, messages TEXT NOT NULL, response TEXT NOT NULL,
    finish_reason TEXT NOT NULL, temperature REAL NOT NULL, prefix_reused INTEGER NOT NULL,
    prefix_break TEXT, parent_span_id TEXT, latency_s REAL NOT NULL, created_at REAL NOT NULL);
CREATE UNIQUE INDEX IF NOT EXISTS spans_order ON spans (rollout_id, attempt, seq);
CREATE TABLE IF NOT EXISTS rewards (
    rollout_id TEXT NOT NULL REFERENCES rollouts (id), attempt INTEGER NOT NULL,
    value REAL NOT NULL, span_seq INTEGER, role TEXT, name TEXT NOT NULL,
    created_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS rewards_attempt ON rewards (rollout_id, attempt);
CREATE TABLE IF NOT EXISTS versions (
    role TEXT NOT NULL, version INTEGER NOT NULL, path TEXT NOT NULL, created_at REAL NOT NULL,
    PRIMARY KEY (role, version));
"""

# Column order equals field order of the records, so rows zip straight into them.
_ROLLOUT_COLS = tuple(Rollout.model_fields)
_SPAN_COLS = tuple(Span.model_fields)
_REWARD_COLS = tuple(Reward.model_fields)
_SELECT_ROLLOUT = f"SELECT {', '.join(_ROLLOUT_COLS)} FROM rollouts"
_MUTABLE = tuple(c for c in _ROLLOUT_COLS if c not in ("id", "task_id", "max_attempts"))
_UPDATE_ROLLOUT = (
    f"UPDATE rollouts SET {', '.join(f'{c} = ?' for c in _MUTABLE)} WHERE id = ? AND status = ?"
)
_INSERT_SPAN = (
    f"INSERT INTO spans ({', '.join(_SPAN_COLS)}) VALUES ({', '.join('?' * len(_SPAN_COLS))})"
)
_INSERT_REWARD = (
    f"INSERT INTO rewards ({', '.join(_REWARD_COLS)}) VALUES ({', '.join('?' * len(_REWARD_COLS))})"
)


_ADDED_COLUMNS = {"rewards": {"role": "TEXT"}}
"""Columns added after a table was first shipped: files written before get them on open."""


def _add_missing_columns(db: sqlite3.Connection) -> None:
    for table, columns in _ADDED_COLUMNS.items():
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        for name, kind in columns.items():
            if name not in have:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")


def _json(value: object) -> str:
    # Sorted keys: identical tasks serialize identically, so re-adding one is detected.
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _rollout(row: Sequence[object]) -> Rollout:
    return Rollout.model_validate(dict(zip(_ROLLOUT_COLS, row, strict=True)))


def _span_row(s: Span) -> tuple[object, ...]:
    return (
        s.id, s.rollout_id, s.attempt, s.seq, s.role, s.policy_version,
        pack_ids(s.prompt_ids), pack_ids(s.completion_ids), pack_floats(s.logprobs),
        # Key order kept (not _json): messages read back exactly as the agent sent them.
        orjson.dumps(s.messages).decode(), orjson.dumps(s.response).decode(),
        s.finish_reason, s.temperature, s.prefix_reused, s.prefix_break, s.parent_span_id, s.latency_s, s.created_at,
    )  # fmt: skip


def _span(row: Sequence[object]) -> Span:
    fields: dict[str, Any] = dict(zip(_SPAN_COLS, row, strict=True))
    fields["prompt_ids"] = unpack_ids(fields["prompt_ids"])
    fields["completion_ids"] = unpack_ids(fields["completion_ids"])
    fields["logprobs"] = unpack_floats(fields["logprobs"])
    fields["messages"] = orjson.loads(fields["messages"])
    fields["response"] = orjson.loads(fields["response"])
    # Validated on the way in; re-validating thousands of ids per read would be waste.
    return Span.model_construct(**fields)


class SqliteStore:
    """The Store protocol on SQLite; safe to share between threads."""

    def __init__(self, path: str | Path = ":memory:") -> None:
        self.path = str(path)
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per call.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.RLock()
        self._db.execute("PRAGMA busy_timeout = 10000")  # another process may hold the file
        self._db.execute("PRAGMA journal_mode = WAL")
        # NORMAL under WAL: a committed write survives a process crash, not a power cut.
        self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.execute("PRAGMA foreign_keys = ON")
        with self._tx() as db:
            for statement in _SCHEMA.split(";"):  # executescript would commit mid-transaction
                db.execute(statement)
            _add_missing_columns(db)

    # -- plumbing -------------------------------------------------------------------------

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken before reading so nobody changes what we read."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def _get(self, db: sqlite3.Connection, rollout_id: str) -> Rollout:
        row = db.execute(f"{_SELECT_ROLLOUT} WHERE id = ?", (rollout_id,)).fetchone()
        if row is None:
            raise NotFound(f"no rollout {rollout_id!r}")
        return _rollout(row)

    def _transition(
        self, db: sqlite3.Connection, r: Rollout, to: RolloutStatus, **changes: object
    ) -> Rollout:
        """The only place a rollout's status changes; refuses what VALID_TRANSITIONS lacks."""
        if to not in VALID_TRANSITIONS[r.status]:
            raise InvalidTransition(
                f"rollout {r.id}: {r.status.value} -> {to.value} is not allowed"
            )
        new = r.model_copy(update={"status": to, **changes})
        values = [getattr(new, c) for c in _MUTABLE]
        cur = db.execute(_UPDATE_ROLLOUT, (*values, r.id, r.status.value))
        if cur.rowcount != 1:  # another process changed it between our read and write
            raise InvalidTransition(f"rollout {r.id} changed concurrently")
        return new

    def _running(self, db: sqlite3.Connection, rollout_id: str, attempt: int) -> Rollout:
        """The rollout, if `attempt` is its running attempt; else LeaseLost."""
        r = self._get(db, rollout_id)
        if r.status is not RolloutStatus.running or r.attempt != attempt:
            raise LeaseLost(
                f"rollout {rollout_id} attempt {attempt} is not running "
                f"(now {r.status.value}, attempt {r.attempt})"
            )
        return r

    # -- tasks ----------------------------------------------------------------------------

    def add_tasks(self, tasks: list[Task]) -> None:
        with self._tx() as db:
            for t in tasks:
                row = (t.id, _json(t.input), _json(t.answer), t.split)
                cur = db.execute(
                    "INSERT INTO tasks VALUES (?, ?, ?, ?) ON CONFLICT (id) DO NOTHING", row
                )
                if cur.rowcount == 0:
                    old = db.execute("SELECT * FROM tasks WHERE id = ?", (t.id,)).fetchone()
                    if tuple(old) != row:
                        raise Conflict(f"task {t.id!r} already exists with different content")

    def get_task(self, task_id: str) -> Task:
        with self._lock:
            row = self._db.execute("SELECT * FROM tasks WHERE id = ?", (task_id,)).fetchone()
        if row is None:
            raise NotFound(f"no task {task_id!r}")
        return _task(row)

    def tasks(self, split: str | None = None) -> list[Task]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM tasks WHERE ?1 IS NULL OR split = ?1 ORDER BY rowid", (split,)
            ).fetchall()
        return [_task(r) for r in rows]

    # -- rollout lifecycle ----------------------------------------------------------------

    def enqueue(
        self, task_ids: list[str], group_id: str | None = None, max_attempts: int = 3
    ) -> list[Rollout]:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        now = time.time()
        new = [
            Rollout(
                id=uuid.uuid4().hex[:16],
                task_id=t,
                group_id=group_id,
                max_attempts=max_attempts,
                created_at=now,
            )
            for t in task_ids
        ]
        with self._tx() as db:
            wanted = sorted(set(task_ids))
            found = {
                r[0]
                for r in db.execute(
                    "SELECT id FROM tasks WHERE id IN (SELECT value FROM json_each(?))",
                    (orjson.dumps(wanted).decode(),),
                )
            }
            if missing := [t for t in wanted if t not in found]:
                raise NotFound(f"no task {missing[0]!r}")
            db.executemany(
                f"INSERT INTO rollouts ({', '.join(_ROLLOUT_COLS)}) "
                f"VALUES ({', '.join('?' * len(_ROLLOUT_COLS))})",
                [[getattr(r, c) for c in _ROLLOUT_COLS] for r in new],
            )
        return new

    def claim(self, runner_id: str, n: int = 1, lease_s: float = 30.0) -> list[Rollout]:
        if n < 1:
            raise ValueError("claim at least one rollout")
        with self._tx() as db:
            now = time.time()
            self._requeue_expired(db, now)
            rows = db.execute(
                f"{_SELECT_ROLLOUT} WHERE status = 'queued' ORDER BY created_at, rowid LIMIT ?",
                (n,),
            ).fetchall()
            return [
                self._transition(
                    db,
                    r,
                    RolloutStatus.running,
                    attempt=r.attempt + 1,
                    runner_id=runner_id,
                    started_at=now,
                    lease_expires_at=now + lease_s,
                    error=None,
                )
                for r in map(_rollout, rows)
            ]

    def heartbeat(self, rollout_id: str, attempt: int, lease_s: float = 30.0) -> Rollout:
        with self._tx() as db:
            r = self._running(db, rollout_id, attempt)
            expires = time.time() + lease_s
            db.execute("UPDATE rollouts SET lease_expires_at = ? WHERE id = ?", (expires, r.id))
            return r.model_copy(update={"lease_expires_at": expires})

    def get_rollout(self, rollout_id: str) -> Rollout:
        with self._lock:
            return self._get(self._db, rollout_id)

    def finish(
        self,
        rollout_id: str,
        attempt: int,
        status: RolloutStatus,
        answer: str | None = None,
        reward: float | None = None,
        error: str | None = None,
    ) -> Rollout:
        """Final status for `attempt`. A queued rollout can only be failed (cancelled) with
        attempt 0, i.e. before any claim; after one, a queued rollout means the caller's
        lease was lost, so that is LeaseLost rather than a cancel."""
        status = RolloutStatus(status)
        if status not in FINISHED:
            raise InvalidTransition(f"finish needs a final status, not {status.value}")
        with self._tx() as db:
            r = self._get(db, rollout_id)
            if r.attempt != attempt or (r.status is RolloutStatus.queued and attempt > 0):
                raise LeaseLost(
                    f"rollout {rollout_id} attempt {attempt} is not the current attempt "
                    f"(now {r.status.value}, attempt {r.attempt})"
                )
            now = time.time()
            new = self._transition(
                db, r, status, answer=answer, reward=reward, error=error, finished_at=now,
                runner_id=None, lease_expires_at=None,
            )  # fmt: skip
            if reward is not None:
                final = Reward(rollout_id=rollout_id, attempt=attempt, value=reward, created_at=now)
                db.execute(_INSERT_REWARD, [getattr(final, c) for c in _REWARD_COLS])
            return new

    def requeue_expired(self, now: float | None = None) -> list[Rollout]:
        with self._tx() as db:
            return self._requeue_expired(db, time.time() if now is None else now)

    def _requeue_expired(self, db: sqlite3.Connection, now: float) -> list[Rollout]:
        rows = db.execute(
            f"{_SELECT_ROLLOUT} WHERE status = 'running' AND lease_expires_at < ?", (now,)
        ).fetchall()
        out = []
        for r in map(_rollout, rows):
            changes: dict[str, object] = {"error": "lease expired"}
            to = RolloutStatus.queued
            if r.attempt >= r.max_attempts:
                changes = {"error": f"lease expired after {r.attempt} attempts", "finished_at": now}
                to = RolloutStatus.timed_out
            out.append(
                self._transition(db, r, to, runner_id=None, lease_expires_at=None, **changes)
            )
        return out

    def rollouts(
        self,
        status: RolloutStatus | None = None,
        group_id: str | None = None,
        task_id: str | None = None,
        limit: int | None = None,
    ) -> list[Rollout]:
        status_value = None if status is None else RolloutStatus(status).value
        where, args = [], []
        for col, val in (("status", status_value), ("group_id", group_id), ("task_id", task_id)):
            if val is not None:
                where.append(f"{col} = ?")
                args.append(val)
        sql = _SELECT_ROLLOUT + (f" WHERE {' AND '.join(where)}" if where else "")
        sql += " ORDER BY created_at, rowid"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [_rollout(r) for r in rows]

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM rollouts GROUP BY status")
            found = dict(rows.fetchall())
        return {s.value: found.get(s.value, 0) for s in RolloutStatus}

    # -- spans and rewards ----------------------------------------------------------------

    def add_span(self, span: Span) -> None:
        self.add_spans([span])

    def add_spans(self, spans: list[Span]) -> None:
        rows = [_span_row(s) for s in spans]  # pack outside the lock
        with self._tx() as db:
            for rollout_id, attempt in {(s.rollout_id, s.attempt) for s in spans}:
                self._running(db, rollout_id, attempt)
            try:
                db.executemany(_INSERT_SPAN, rows)
            except sqlite3.IntegrityError as e:
                raise Conflict(f"span id or (rollout, attempt, seq) already recorded: {e}") from e

    def add_reward(self, reward: Reward) -> None:
        with self._tx() as db:
            self._running(db, reward.rollout_id, reward.attempt)
            db.execute(_INSERT_REWARD, [getattr(reward, c) for c in _REWARD_COLS])

    def spans(self, rollout_id: str, attempt: int | None = None) -> list[Span]:
        with self._lock:
            a = self._get(self._db, rollout_id).attempt if attempt is None else attempt
            rows = self._db.execute(
                f"SELECT {', '.join(_SPAN_COLS)} FROM spans "
                "WHERE rollout_id = ? AND attempt = ? ORDER BY seq",
                (rollout_id, a),
            ).fetchall()
        return [_span(r) for r in rows]

    def rewards(self, rollout_id: str, attempt: int | None = None) -> list[Reward]:
        with self._lock:
            a = self._get(self._db, rollout_id).attempt if attempt is None else attempt
            rows = self._db.execute(
                f"SELECT {', '.join(_REWARD_COLS)} FROM rewards "
                "WHERE rollout_id = ? AND attempt = ? ORDER BY rowid",
                (rollout_id, a),
            ).fetchall()
        return [Reward.model_validate(dict(zip(_REWARD_COLS, r, strict=True))) for r in rows]

    # -- policy versions ------------------------------------------------------------------

    def publish_version(self, pv: PolicyVersion) -> None:
        with self._tx() as db:
            old = db.execute(
                "SELECT path FROM versions WHERE role = ? AND version = ?", (pv.role, pv.version)
            ).fetchone()
            if old is not None and old[0] != pv.path:
                raise Conflict(f"{pv.role} version {pv.version} already published at {old[0]}")
            if old is None:
                db.execute(
                    "INSERT INTO versions VALUES (?, ?, ?, ?)",
                    (pv.role, pv.version, pv.path, pv.created_at),
                )

    def latest_version(self, role: str = "policy") -> PolicyVersion | None:
        with self._lock:
            row = self._db.execute(
                "SELECT role, version, path, created_at FROM versions WHERE role = ? "
                "ORDER BY version DESC LIMIT 1",
                (role,),
            ).fetchone()
        if row is None:
            return None
        return PolicyVersion(role=row[0], version=row[1], path=row[2], created_at=row[3])

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _task(row: Sequence[object]) -> Task:
    task_id, input_json, answer_json, split = row
    return Task(
        id=task_id,  # type: ignore[arg-type]
        input=orjson.loads(input_json),  # type: ignore[arg-type]
        answer=orjson.loads(answer_json),  # type: ignore[arg-type]
        split=split,  # type: ignore[arg-type]
    )


if TYPE_CHECKING:  # mypy checks every signature against the Store protocol
    _: Store = SqliteStore()
