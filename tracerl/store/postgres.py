"""The shared store: PostgreSQL, for runners, gateways and trainers on several machines.

The Store protocol, lifecycle and row codecs (schema.py) of SqliteStore, on PostgreSQL;
its layout and migrations are in postgres_schema.py. Open one with open_store (open.py).

Connections. A pool (psycopg_pool) lends each call its own connection; every write is one
transaction (`_tx`); a read outside one sees a consistent snapshot per statement.

Concurrency. Postgres runs transactions at once where SQLite takes turns, so each write
locks the rows its decision rests on before reading them: a claim takes queued rollouts
`FOR UPDATE SKIP LOCKED` (concurrent claimers pass each other, never sharing a rollout),
a finish or heartbeat locks its rollout `FOR UPDATE`, and recording spans or rewards locks
it `FOR SHARE`, so a lease cannot expire between the check that the attempt runs and the
write. Appending spans (the store choosing their seqs) locks the rollout `FOR UPDATE`, so
two appenders of one attempt take turns; issuing a version holds a transaction-scoped
advisory lock, so two issuers never read the same highest version. Every status change
still goes through `_transition`, whose UPDATE carries `WHERE status = <the status read>`,
refusing anything VALID_TRANSITIONS lacks.

Time. Leases are judged by the database's clock (callers' clocks may disagree): a store
measures its offset from it once, when it opens, and corrects every time it stamps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import Enum
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg_pool import ConnectionPool, PoolClosed

from tracerl.store import Conflict, InvalidTransition, NotFound, Store, StoreError
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
from tracerl.store.postgres_schema import (
    ASSET_LOCK,
    CLAIMABLE,
    DB_NOW,
    EXPIRED,
    INSERT_REWARD,
    INSERT_ROLLOUT,
    INSERT_SPAN,
    INSERT_TASK,
    INSERT_VERSION,
    ISSUE_LOCK,
    LATEST_VERSION,
    MAX_SEQ,
    MAX_VERSION,
    SELECT_REWARDS,
    SELECT_ROLLOUT,
    SELECT_SPANS,
    SELECT_TASK,
    SET_VERSION_PATH_PG,
    UPDATE_ROLLOUT,
    VERSION_PATH,
    migrate,
)
from tracerl.store.schema import (
    MUTABLE,
    REWARD_COLS,
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
from tracerl.store.sessions import open_postgres_session
from tracerl.types import (
    PolicyVersion,
    Reward,
    Rollout,
    RolloutStatus,
    Span,
    Task,
)

__all__ = ["PostgresStore"]

Cursor = psycopg.Cursor[tuple[Any, ...]]
Move = tuple[Rollout, dict[str, object]]
"""A rollout as read, and the fields its transition changes besides the status."""


def _values(record: Rollout | Reward, cols: Sequence[str]) -> list[object]:
    # Statuses go in as their text: what the CHECK constraint and WHERE status = ... expect.
    return [v.value if isinstance(v, Enum) else v for v in (getattr(record, c) for c in cols)]


class PostgresStore(SqlAssets):
    """The Store protocol on PostgreSQL; share it between threads and processes freely."""

    _assets_sql = AssetSql("%s", ASSET_LOCK)  # puts of versions take turns

    def __init__(self, url: str, pool_size: int = 8, connect_timeout_s: float = 30.0) -> None:
        self.url = url
        self._where = url.split("@")[-1]  # for messages: the URL without credentials
        # autocommit: a read is one statement; writes open their transaction in _tx.
        self._pool: ConnectionPool[psycopg.Connection[tuple[Any, ...]]] = ConnectionPool(
            url, min_size=1, max_size=pool_size, kwargs={"autocommit": True}, open=False
        )
        self._closed = False
        self._pool.open(wait=True, timeout=connect_timeout_s)
        try:
            with self._pool.connection() as conn:
                migrate(conn)
                before = time.time()
                (db_now,) = conn.execute(DB_NOW).fetchone() or (before,)
                # What to add to this machine's clock to read the database's.
                self._offset = float(db_now) - (before + time.time()) / 2
        except BaseException:
            self._pool.close()
            raise

    # -- plumbing -------------------------------------------------------------------------

    @contextmanager
    def _read(self) -> Iterator[Cursor]:
        """A cursor on a pooled connection, outside any transaction."""
        if self._closed:
            raise StoreError(f"the store {self._where} is closed")
        try:
            conn = self._pool.getconn()
        except PoolClosed as e:  # closed by another thread after the check above
            raise StoreError(f"the store {self._where} is closed") from e
        try:
            with conn.cursor() as cur:
                yield cur
        finally:
            self._pool.putconn(conn)  # a broken connection is discarded, not lent again

    @contextmanager
    def _tx(self) -> Iterator[Cursor]:
        """One transaction: committed when the block ends, rolled back if it raises."""
        with self._read() as cur, cur.connection.transaction():
            yield cur

    def _now(self) -> float:
        """The database's clock, in Unix seconds (see the module doc)."""
        return time.time() + self._offset

    def _get(self, cur: Cursor, rollout_id: str, lock: str = "") -> Rollout:
        """The rollout; `lock` ("FOR UPDATE", "FOR SHARE") holds it until the tx ends."""
        row = cur.execute(f"{SELECT_ROLLOUT} WHERE id = %s {lock}", (rollout_id,)).fetchone()
        if row is None:
            raise NotFound(f"no rollout {rollout_id!r}")
        return rollout_from_row(row)

    def _transition(self, cur: Cursor, moves: list[Move], to: RolloutStatus) -> list[Rollout]:
        """The only place a rollout's status changes; refuses what VALID_TRANSITIONS lacks.
        All moves are written in one round trip; each only if its status is still the one
        read."""
        for r, _ in moves:
            check_move(r, to)
        new = [r.model_copy(update={"status": to, **changes}) for r, changes in moves]
        if not new:
            return []
        rows = [
            (*_values(n, MUTABLE), r.id, r.status.value)
            for n, (r, _) in zip(new, moves, strict=True)
        ]
        if len(rows) == 1:  # a finish, most claims: no pipeline to set up
            cur.execute(UPDATE_ROLLOUT, rows[0])
        else:  # several in one round trip
            cur.executemany(UPDATE_ROLLOUT, rows)
        if cur.rowcount != len(new):  # a row changed after we read it without a lock
            raise InvalidTransition(f"rollouts {[r.id for r, _ in moves]} changed concurrently")
        return new

    def _running(self, cur: Cursor, rollout_id: str, attempt: int, lock: str) -> Rollout:
        """The rollout, if `attempt` is its running attempt; else LeaseLost."""
        return check_running(self._get(cur, rollout_id, lock), attempt)

    # -- tasks ----------------------------------------------------------------------------

    def add_tasks(self, tasks: list[Task]) -> None:
        rows = [task_row(t) for t in tasks]
        if not rows:
            return
        with self._tx() as cur:
            cur.executemany(INSERT_TASK, rows)
            # Whatever was there before (or came first in this batch) must match exactly.
            stored = dict(
                (r[0], tuple(r))
                for r in cur.execute(f"{SELECT_TASK} WHERE id = ANY(%s)", ([r[0] for r in rows],))
            )
            for row in rows:
                if stored[row[0]] != row:
                    raise Conflict(f"task {row[0]!r} already exists with different content")

    def get_task(self, task_id: str) -> Task:
        with self._read() as cur:
            row = cur.execute(f"{SELECT_TASK} WHERE id = %s", (task_id,)).fetchone()
        if row is None:
            raise NotFound(f"no task {task_id!r}")
        return task_from_row(row)

    def tasks(self, split: str | None = None) -> list[Task]:
        with self._read() as cur:
            rows = cur.execute(
                f"{SELECT_TASK} WHERE %s::text IS NULL OR split = %s ORDER BY seq", (split, split)
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
        new = new_rollouts(task_ids, group_id, max_attempts, self._now(), assets, seeds)
        with self._tx() as cur:
            wanted = sorted(set(task_ids))
            found = {
                r[0] for r in cur.execute("SELECT id FROM tasks WHERE id = ANY(%s)", (wanted,))
            }
            check_found(wanted, found)
            cur.executemany(INSERT_ROLLOUT, [rollout_row(r) for r in new])
        return new

    def claim(self, runner_id: str, n: int = 1, lease_s: float = 30.0) -> list[Rollout]:
        if n < 1:
            raise ValueError("claim at least one rollout")
        with self._tx() as cur:
            now = self._now()
            self._requeue_expired(cur, now)
            rows = cur.execute(CLAIMABLE, (n,)).fetchall()
            moves = [
                (r, claim_changes(r, runner_id, now, lease_s)) for r in map(rollout_from_row, rows)
            ]
            return self._transition(cur, moves, RolloutStatus.running)

    open_session = open_postgres_session

    def heartbeat(self, rollout_id: str, attempt: int, lease_s: float = 30.0) -> Rollout:
        with self._tx() as cur:
            r = self._running(cur, rollout_id, attempt, "FOR UPDATE")
            expires = self._now() + lease_s
            cur.execute("UPDATE rollouts SET lease_expires_at = %s WHERE id = %s", (expires, r.id))
            return r.model_copy(update={"lease_expires_at": expires})

    def get_rollout(self, rollout_id: str) -> Rollout:
        with self._read() as cur:
            return self._get(cur, rollout_id)

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
        with self._tx() as cur:
            r = self._get(cur, rollout_id, "FOR UPDATE")
            check_current(r, attempt)
            now = self._now()
            changes = finish_changes(answer, reward, error, now)
            (new,) = self._transition(cur, [(r, changes)], status)
            if reward is not None:
                final = Reward(rollout_id=rollout_id, attempt=attempt, value=reward, created_at=now)
                cur.execute(INSERT_REWARD, _values(final, REWARD_COLS))
            return new

    def requeue_expired(self, now: float | None = None) -> list[Rollout]:
        with self._tx() as cur:
            return self._requeue_expired(cur, self._now() if now is None else now)

    def _requeue_expired(self, cur: Cursor, now: float) -> list[Rollout]:
        """Expired leases back to the queue, or timed out when out of attempts. Rows another
        transaction holds are skipped: it is finishing or extending them right now."""
        expired = [rollout_from_row(row) for row in cur.execute(EXPIRED, (now,)).fetchall()]
        moves: dict[RolloutStatus, list[Move]] = {
            RolloutStatus.queued: [],
            RolloutStatus.timed_out: [],
        }
        for r in expired:
            to, changes = expiry(r, now)
            moves[to].append((r, changes))
        out = [new for to, batch in moves.items() for new in self._transition(cur, batch, to)]
        order = {r.id: i for i, r in enumerate(expired)}
        return sorted(out, key=lambda r: order[r.id])

    def rollouts(
        self,
        status: RolloutStatus | None = None,
        group_id: str | None = None,
        task_id: str | None = None,
        limit: int | None = None,
    ) -> list[Rollout]:
        sql, args = rollouts_query("%s", "seq", status, group_id, task_id, limit)
        with self._read() as cur:
            rows = cur.execute(sql, args).fetchall()
        return [rollout_from_row(r) for r in rows]

    def counts(self) -> dict[str, int]:
        with self._read() as cur:
            found = dict(cur.execute("SELECT status, COUNT(*) FROM rollouts GROUP BY status"))
        return {s.value: int(found.get(s.value, 0)) for s in RolloutStatus}

    # -- spans and rewards ----------------------------------------------------------------

    def add_span(self, span: Span) -> None:
        self.add_spans([span])

    def add_spans(self, spans: list[Span]) -> None:
        rows = [span_row(s) for s in spans]  # pack before taking a connection
        with self._tx() as cur:
            # Sorted: two batches touching the same rollouts lock them in one order.
            for rollout_id, attempt in attempts(spans):
                self._running(cur, rollout_id, attempt, "FOR SHARE")
            _insert_spans(cur, rows)

    def append_spans(self, spans: list[Span]) -> list[int]:
        rows = [span_row(s) for s in spans]
        with self._tx() as cur:
            highest = {}
            for rollout_id, attempt in attempts(spans):
                # FOR UPDATE: another appender of this attempt waits until we commit.
                self._running(cur, rollout_id, attempt, "FOR UPDATE")
                row = cur.execute(MAX_SEQ, (rollout_id, attempt)).fetchone()
                highest[(rollout_id, attempt)] = row[0] if row else None
            seqs = next_seqs(spans, highest)
            _insert_spans(cur, [with_seq(r, q) for r, q in zip(rows, seqs, strict=True)])
        return seqs

    def add_reward(self, reward: Reward) -> None:
        with self._tx() as cur:
            self._running(cur, reward.rollout_id, reward.attempt, "FOR SHARE")
            cur.execute(INSERT_REWARD, _values(reward, REWARD_COLS))

    def spans(self, rollout_id: str, attempt: int | None = None) -> list[Span]:
        with self._read() as cur:
            a = self._get(cur, rollout_id).attempt if attempt is None else attempt
            rows = cur.execute(SELECT_SPANS, (rollout_id, a)).fetchall()
        return [span_from_row(r) for r in rows]

    def rewards(self, rollout_id: str, attempt: int | None = None) -> list[Reward]:
        with self._read() as cur:
            a = self._get(cur, rollout_id).attempt if attempt is None else attempt
            rows = cur.execute(SELECT_REWARDS, (rollout_id, a)).fetchall()
        return [reward_from_row(r) for r in rows]

    # -- policy versions ------------------------------------------------------------------

    def issue_version(self, roles: list[str]) -> int:
        wanted = sorted(set(roles))
        with self._tx() as cur:
            cur.execute(ISSUE_LOCK)  # held until commit: issuers take turns
            row = cur.execute(MAX_VERSION, (wanted,)).fetchone()
            version = next_version(roles, row[0] if row else None)
            now = self._now()
            cur.executemany(INSERT_VERSION, [(r, version, "", now) for r in wanted])
        return version

    def publish_version(self, pv: PolicyVersion) -> None:
        with self._tx() as cur:
            cur.execute(INSERT_VERSION, (pv.role, pv.version, pv.path, pv.created_at))
            if cur.rowcount == 1:
                return
            old = cur.execute(VERSION_PATH, (pv.role, pv.version)).fetchone() or ("",)
            if sets_path(pv, old[0]):
                cur.execute(SET_VERSION_PATH_PG, (pv.path, pv.role, pv.version))

    def latest_version(self, role: str = "policy") -> PolicyVersion | None:
        with self._read() as cur:
            row = cur.execute(LATEST_VERSION, (role,)).fetchone()
        return None if row is None else version_from_row(row)

    def close(self) -> None:
        """Close the pool once (waiting for calls in flight); later calls raise StoreError."""
        if not self._closed:
            self._closed = True
            self._pool.close()


def _insert_spans(cur: Cursor, rows: list[tuple[object, ...]]) -> None:
    try:
        cur.executemany(INSERT_SPAN, rows)
    except psycopg.errors.UniqueViolation as e:
        raise Conflict(f"span id or (rollout, attempt, seq) already recorded: {e}") from e


if TYPE_CHECKING:  # mypy checks every signature against the Store protocol
    _: Store = PostgresStore("")
