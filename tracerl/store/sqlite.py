"""The embedded store: SQLite in one file (WAL), or in memory for tests.

Threads. One training process calls one SqliteStore from several threads at once: the
gateway's store workers (span writes, rollout lookups, the /store API), the runners'
`asyncio.to_thread` workers (claims, heartbeats, finishes), the async source's issuing
thread, and the trainer (batches, published versions). The store owns its connection and
nobody else touches it: every statement runs inside `_tx` (one write transaction) or
`_read` (one read), and both hold the store's lock for as long as the connection is in
use, cursors included. So statements of different threads never interleave on the
connection, and each write is one short IMMEDIATE transaction: a claim is atomic and two
claimers never get the same rollout. (`rollout_now` and `append_now` alone use a second
connection, for a caller that must not wait for that lock: the gateway's event loop;
sqlite_loop.py.)
Other processes on the same file are other connections; WAL lets them read while one
writes, and IMMEDIATE plus busy_timeout makes writers take turns. After `close`
(idempotent) every call raises StoreError.

Every rollout state change goes through `_transition`, which refuses anything not in
VALID_TRANSITIONS. The layout and the row codecs are in schema.py.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from tracerl.store import (
    Conflict,
    InvalidTransition,
    LocalStore,
    NotFound,
    Store,
    StoreError,
)
from tracerl.store.assets import AssetSql, SqlAssets
from tracerl.store.lifecycle import (
    attempts,
    check_current,
    check_found,
    check_move,
    check_running,
    claim_changes,
    expiry,
    final_status,
    finish_changes,
    new_rollouts,
    next_seqs,
    next_version,
    sets_path,
)
from tracerl.store.schema import (
    INSERT_REWARD,
    INSERT_ROLLOUT,
    INSERT_SPAN,
    MUTABLE,
    REWARD_COLS,
    SCHEMA,
    SELECT_ROLLOUT,
    SET_VERSION_PATH,
    SPAN_COLS,
    UPDATE_ROLLOUT,
    add_missing_columns,
    reward_from_row,
    rollout_from_row,
    rollout_row,
    rollouts_query,
    span_from_row,
    span_row,
    task_from_row,
    task_row,
    version_from_row,
    with_seq,
)
from tracerl.store.sessions import open_sqlite_session
from tracerl.store.sqlite_loop import LoopConnection
from tracerl.types import (
    PolicyVersion,
    Reward,
    Rollout,
    RolloutStatus,
    Span,
    Task,
)

__all__ = ["SqliteStore"]


class SqliteStore(SqlAssets, LoopConnection):
    """The Store protocol on SQLite; safe to share between threads (see the module doc)."""

    _assets_sql = AssetSql("?")  # IMMEDIATE transactions: puts take turns

    def __init__(self, path: str | Path = ":memory:") -> None:
        self.path = str(path)
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per call.
        # check_same_thread=False: many threads use it, serialised by _lock (module doc).
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        # Reentrant so that a nested _tx fails loudly in SQLite instead of deadlocking.
        self._lock = threading.RLock()
        self._closed = False
        self._init_loop_connection()
        self._db.execute("PRAGMA busy_timeout = 10000")  # another process may hold the file
        self._db.execute("PRAGMA journal_mode = WAL")
        # NORMAL under WAL: a committed write survives a process crash, not a power cut.
        self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.execute("PRAGMA foreign_keys = ON")
        with self._tx() as db:
            for statement in SCHEMA.split(";"):  # executescript would commit mid-transaction
                db.execute(statement)
            add_missing_columns(db)

    # -- plumbing: the only two ways to the connection ------------------------------------

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken before reading so nobody changes what we read."""
        with self._read() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """The connection, held by this thread alone until the block ends (fetch inside)."""
        with self._lock:
            if self._closed:
                raise StoreError(f"the store {self.path} is closed")
            yield self._db

    def _get(self, db: sqlite3.Connection, rollout_id: str) -> Rollout:
        row = db.execute(f"{SELECT_ROLLOUT} WHERE id = ?", (rollout_id,)).fetchone()
        if row is None:
            raise NotFound(f"no rollout {rollout_id!r}")
        return rollout_from_row(row)

    def _transition(
        self, db: sqlite3.Connection, r: Rollout, to: RolloutStatus, **changes: object
    ) -> Rollout:
        """The only place a rollout's status changes; refuses what VALID_TRANSITIONS lacks."""
        check_move(r, to)
        new = r.model_copy(update={"status": to, **changes})
        values = [getattr(new, c) for c in MUTABLE]
        cur = db.execute(UPDATE_ROLLOUT, (*values, r.id, r.status.value))
        if cur.rowcount != 1:  # another process changed it between our read and write
            raise InvalidTransition(f"rollout {r.id} changed concurrently")
        return new

    def _running(self, db: sqlite3.Connection, rollout_id: str, attempt: int) -> Rollout:
        """The rollout, if `attempt` is its running attempt; else LeaseLost."""
        return check_running(self._get(db, rollout_id), attempt)

    # -- tasks ----------------------------------------------------------------------------

    def add_tasks(self, tasks: list[Task]) -> None:
        with self._tx() as db:
            for t in tasks:
                row = task_row(t)
                cur = db.execute(
                    "INSERT INTO tasks VALUES (?, ?, ?, ?) ON CONFLICT (id) DO NOTHING", row
                )
                if cur.rowcount == 0:
                    old = db.execute("SELECT * FROM tasks WHERE id = ?", (t.id,)).fetchone()
                    if tuple(old) != row:
                        raise Conflict(f"task {t.id!r} already exists with different content")

    def get_task(self, task_id: str) -> Task:
        with self._read() as db:
            row = db.execute("SELECT * FROM tasks WHERE id = ?", (task_id,)).fetchone()
        if row is None:
            raise NotFound(f"no task {task_id!r}")
        return task_from_row(row)

    def tasks(self, split: str | None = None) -> list[Task]:
        with self._read() as db:
            rows = db.execute(
                "SELECT * FROM tasks WHERE ?1 IS NULL OR split = ?1 ORDER BY rowid", (split,)
            ).fetchall()
        return [task_from_row(r) for r in rows]

    # -- rollout lifecycle ----------------------------------------------------------------

    def enqueue(
        self,
        task_ids: list[str],
        group_id: str | None = None,
        max_attempts: int = 3,
        assets: dict[str, int] | None = None,
        seeds: list[int] | None = None,
    ) -> list[Rollout]:
        new = new_rollouts(task_ids, group_id, max_attempts, time.time(), assets, seeds)
        with self._tx() as db:
            wanted = sorted(set(task_ids))
            found = {
                r[0]
                for r in db.execute(
                    "SELECT id FROM tasks WHERE id IN (SELECT value FROM json_each(?))",
                    (orjson.dumps(wanted).decode(),),
                )
            }
            check_found(wanted, found)
            db.executemany(INSERT_ROLLOUT, [rollout_row(r) for r in new])
        return new

    def claim(self, runner_id: str, n: int = 1, lease_s: float = 30.0) -> list[Rollout]:
        if n < 1:
            raise ValueError("claim at least one rollout")
        with self._tx() as db:
            now = time.time()
            self._requeue_expired(db, now)
            rows = db.execute(
                f"{SELECT_ROLLOUT} WHERE status = 'queued' ORDER BY created_at, rowid LIMIT ?",
                (n,),
            ).fetchall()
            return [
                self._transition(
                    db, r, RolloutStatus.running, **claim_changes(r, runner_id, now, lease_s)
                )
                for r in map(rollout_from_row, rows)
            ]

    open_session = open_sqlite_session

    def heartbeat(self, rollout_id: str, attempt: int, lease_s: float = 30.0) -> Rollout:
        with self._tx() as db:
            r = self._running(db, rollout_id, attempt)
            expires = time.time() + lease_s
            db.execute("UPDATE rollouts SET lease_expires_at = ? WHERE id = ?", (expires, r.id))
            return r.model_copy(update={"lease_expires_at": expires})

    def get_rollout(self, rollout_id: str) -> Rollout:
        with self._read() as db:
            return self._get(db, rollout_id)

    def finish(
        self,
        rollout_id: str,
        attempt: int,
        status: RolloutStatus,
        answer: str | None = None,
        reward: float | None = None,
        error: str | None = None,
    ) -> Rollout:
        """Final status for `attempt` (who may finish: lifecycle.check_current)."""
        status = final_status(status)
        with self._tx() as db:
            r = self._get(db, rollout_id)
            check_current(r, attempt)
            now = time.time()
            new = self._transition(db, r, status, **finish_changes(answer, reward, error, now))
            if reward is not None:
                final = Reward(rollout_id=rollout_id, attempt=attempt, value=reward, created_at=now)
                db.execute(INSERT_REWARD, [getattr(final, c) for c in REWARD_COLS])
            return new

    def requeue_expired(self, now: float | None = None) -> list[Rollout]:
        with self._tx() as db:
            return self._requeue_expired(db, time.time() if now is None else now)

    def _requeue_expired(self, db: sqlite3.Connection, now: float) -> list[Rollout]:
        rows = db.execute(
            f"{SELECT_ROLLOUT} WHERE status = 'running' AND lease_expires_at < ?", (now,)
        ).fetchall()
        out = []
        for r in map(rollout_from_row, rows):
            to, changes = expiry(r, now)
            out.append(self._transition(db, r, to, **changes))
        return out

    def rollouts(
        self,
        status: RolloutStatus | None = None,
        group_id: str | None = None,
        task_id: str | None = None,
        limit: int | None = None,
    ) -> list[Rollout]:
        sql, args = rollouts_query("?", "rowid", status, group_id, task_id, limit)
        with self._read() as db:
            rows = db.execute(sql, args).fetchall()
        return [rollout_from_row(r) for r in rows]

    def counts(self) -> dict[str, int]:
        with self._read() as db:
            rows = db.execute("SELECT status, COUNT(*) FROM rollouts GROUP BY status")
            found = dict(rows.fetchall())
        return {s.value: found.get(s.value, 0) for s in RolloutStatus}

    # -- spans and rewards ----------------------------------------------------------------

    def add_span(self, span: Span) -> None:
        self.add_spans([span])

    def add_spans(self, spans: list[Span]) -> None:
        rows = [span_row(s) for s in spans]  # pack outside the lock
        with self._tx() as db:
            for rollout_id, attempt in attempts(spans):
                self._running(db, rollout_id, attempt)
            self._insert_spans(db, rows)

    def append_spans(self, spans: list[Span]) -> list[int]:
        rows = [span_row(s) for s in spans]
        with self._tx() as db:  # IMMEDIATE: nobody appends between our MAX and our insert
            return self._append(db, spans, rows)

    def append_groups(self, groups: list[list[Span]]) -> list[list[int] | StoreError]:
        """LocalStore.append_groups: each group in a savepoint of one transaction, so a
        refused group is undone alone, and one commit makes them all durable."""
        rows = [[span_row(s) for s in spans] for spans in groups]
        out: list[list[int] | StoreError] = []
        with self._tx() as db:
            for spans, packed in zip(groups, rows, strict=True):
                db.execute("SAVEPOINT group_")
                try:
                    out.append(self._append(db, spans, packed))
                except StoreError as e:
                    db.execute("ROLLBACK TO group_")
                    out.append(e)
                db.execute("RELEASE group_")
        return out

    def _append(
        self, db: sqlite3.Connection, spans: list[Span], rows: list[tuple[object, ...]]
    ) -> list[int]:
        """Insert `spans` (packed as `rows`) at the next seqs of their running attempts."""
        highest = {}
        for rollout_id, attempt in attempts(spans):
            self._running(db, rollout_id, attempt)
            highest[(rollout_id, attempt)] = db.execute(
                "SELECT MAX(seq) FROM spans WHERE rollout_id = ? AND attempt = ?",
                (rollout_id, attempt),
            ).fetchone()[0]
        seqs = next_seqs(spans, highest)
        self._insert_spans(db, [with_seq(r, q) for r, q in zip(rows, seqs, strict=True)])
        return seqs

    def _insert_spans(self, db: sqlite3.Connection, rows: list[tuple[object, ...]]) -> None:
        try:
            db.executemany(INSERT_SPAN, rows)
        except sqlite3.IntegrityError as e:
            raise Conflict(f"span id or (rollout, attempt, seq) already recorded: {e}") from e

    def add_reward(self, reward: Reward) -> None:
        with self._tx() as db:
            self._running(db, reward.rollout_id, reward.attempt)
            db.execute(INSERT_REWARD, [getattr(reward, c) for c in REWARD_COLS])

    def spans(self, rollout_id: str, attempt: int | None = None) -> list[Span]:
        with self._read() as db:
            a = self._get(db, rollout_id).attempt if attempt is None else attempt
            rows = db.execute(
                f"SELECT {', '.join(SPAN_COLS)} FROM spans "
                "WHERE rollout_id = ? AND attempt = ? ORDER BY seq",
                (rollout_id, a),
            ).fetchall()
        return [span_from_row(r) for r in rows]

    def rewards(self, rollout_id: str, attempt: int | None = None) -> list[Reward]:
        with self._read() as db:
            a = self._get(db, rollout_id).attempt if attempt is None else attempt
            rows = db.execute(
                f"SELECT {', '.join(REWARD_COLS)} FROM rewards "
                "WHERE rollout_id = ? AND attempt = ? ORDER BY rowid",
                (rollout_id, a),
            ).fetchall()
        return [reward_from_row(r) for r in rows]

    # -- policy versions ------------------------------------------------------------------

    def issue_version(self, roles: list[str]) -> int:
        wanted = sorted(set(roles))
        with self._tx() as db:  # IMMEDIATE: two issuers take turns, in any process
            (highest,) = db.execute(
                "SELECT MAX(version) FROM versions WHERE role IN (SELECT value FROM json_each(?))",
                (orjson.dumps(wanted).decode(),),
            ).fetchone()
            version = next_version(roles, highest)
            now = time.time()
            db.executemany(
                "INSERT INTO versions VALUES (?, ?, '', ?)", [(r, version, now) for r in wanted]
            )
        return version

    def publish_version(self, pv: PolicyVersion) -> None:
        with self._tx() as db:
            old = db.execute(
                "SELECT path FROM versions WHERE role = ? AND version = ?", (pv.role, pv.version)
            ).fetchone()
            if old is None:
                db.execute(
                    "INSERT INTO versions VALUES (?, ?, ?, ?)",
                    (pv.role, pv.version, pv.path, pv.created_at),
                )
            elif sets_path(pv, old[0]):
                db.execute(SET_VERSION_PATH, (pv.path, pv.role, pv.version))

    def latest_version(self, role: str = "policy") -> PolicyVersion | None:
        with self._read() as db:
            row = db.execute(
                "SELECT role, version, path, created_at FROM versions WHERE role = ? "
                "ORDER BY version DESC LIMIT 1",
                (role,),
            ).fetchone()
        return None if row is None else version_from_row(row)

    def close(self) -> None:
        """Close the connection once; later calls (from any thread) raise StoreError."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()
        self._close_loop_connection()


if TYPE_CHECKING:  # mypy checks every signature against the Store protocols
    _: Store = SqliteStore()
    _local: LocalStore = SqliteStore()
