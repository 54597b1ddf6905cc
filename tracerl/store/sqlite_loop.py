"""The embedded store's second connection, for the gateway's event loop: a rollout read
and a span append that never wait (LocalStore.rollout_now, append_now).

Under WAL the connection reads the last commit while another connection writes. It waits
on nothing: its lock is only tried, its busy_timeout is 0, and a write whose BEGIN IMMEDIATE
finds the file held fails at once; each says None then, and the caller takes its thread's
way instead. It never checkpoints the WAL itself (wal_autocheckpoint 0: a checkpoint syncs
the disk), so `checkpoint` is for a thread to call; the store's own connection checkpoints
as usual after its writes. An in-memory store has no second connection (None always).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from tracerl.store import StoreError
from tracerl.store.schema import span_row
from tracerl.types import Rollout, Span

__all__ = ["LoopConnection"]


class LoopConnection:
    """rollout_now, append_now and checkpoint, for the SqliteStore inheriting it (over its
    `path`, `_closed`, `_get`, `_append` and `_read`)."""

    if TYPE_CHECKING:
        path: str
        _closed: bool

        def _get(self, db: sqlite3.Connection, rollout_id: str) -> Rollout: ...

        def _append(
            self, db: sqlite3.Connection, spans: list[Span], rows: list[tuple[object, ...]]
        ) -> list[int]: ...

        def _read(self) -> AbstractContextManager[Any]: ...

    def _init_loop_connection(self) -> None:
        self._now: sqlite3.Connection | None = None
        """The second connection, opened by the first call that needs it (under _now_lock)."""
        self._now_lock = threading.Lock()

    def rollout_now(self, rollout_id: str) -> Rollout | None:
        """LocalStore.rollout_now: read on a second connection of its own, which under WAL
        sees the last commit without waiting for a writer; it never waits (busy_timeout 0,
        its lock only tried), and an in-memory store has no second connection: None."""
        with self._now_db() as db:
            if db is None:
                return None
            try:
                return self._get(db, rollout_id)
            except sqlite3.OperationalError as e:  # busy (a checkpoint, a recovery)
                _raise_unless_busy(e)
                return None

    def append_now(self, spans: list[Span]) -> list[int] | None:
        """LocalStore.append_now: append_spans on the second connection, whose BEGIN
        IMMEDIATE fails at once (None) when another connection or process is writing. It
        never checkpoints the WAL itself (a checkpoint syncs the disk): `checkpoint` does,
        and so do this process's other writes."""
        rows = [span_row(s) for s in spans]
        with self._now_db() as db:
            if db is None:
                return None
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:
                _raise_unless_busy(e)
                return None
            try:
                seqs = self._append(db, spans, rows)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            return seqs

    def checkpoint(self) -> None:
        """LocalStore.checkpoint: copy the WAL's pages into the database file, without
        waiting for readers (PASSIVE)."""
        with self._read() as db:
            db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    @contextmanager
    def _now_db(self) -> Iterator[sqlite3.Connection | None]:
        """The second connection, held by this thread alone; None when another thread holds
        it or the store is in memory."""
        if self._closed:
            raise StoreError(f"the store {self.path} is closed")
        if not self._now_lock.acquire(blocking=False):
            yield None
            return
        try:
            yield self._now or self._open_now()
        finally:
            self._now_lock.release()

    def _open_now(self) -> sqlite3.Connection | None:
        if self.path in ("", ":memory:"):
            return None
        self._now = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._now.execute("PRAGMA busy_timeout = 0")
        self._now.execute("PRAGMA synchronous = NORMAL")
        self._now.execute("PRAGMA foreign_keys = ON")
        self._now.execute("PRAGMA wal_autocheckpoint = 0")
        return self._now

    def _close_loop_connection(self) -> None:
        with self._now_lock:
            if self._now is not None:
                self._now.close()
                self._now = None


def _raise_unless_busy(e: sqlite3.OperationalError) -> None:
    """Raise `e` unless it says the file is busy (then the caller tries on a thread)."""
    if "locked" not in str(e) and "busy" not in str(e):
        raise e
