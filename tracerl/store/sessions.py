"""Sessions: rollouts opened by the gateway itself for calls no runner attributed.

An agent that points at plain /v1 without naming a rollout (a coding CLI, a framework run
by hand) is still recorded: the gateway opens a session, a task of split "session" plus one
rollout that starts out running, in one transaction. max_attempts is 1, so a session whose
gateway died is never re-queued to a runner: its lease expires into timed_out.

Both backends build the same records here and differ only in their SQL.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import TYPE_CHECKING

from pydantic import Field

from tracerl.store import schema as sqlite_schema
from tracerl.store.schema import rollout_row, task_row
from tracerl.store.wire import _Body
from tracerl.types import Rollout, RolloutStatus, Task

if TYPE_CHECKING:
    from tracerl.store.postgres import PostgresStore
    from tracerl.store.sqlite import SqliteStore

__all__ = [
    "SESSION_RUNNER",
    "SESSION_SPLIT",
    "SessionRequest",
    "session_records",
    "session_start",
    "session_task_id",
    "open_postgres_session",
    "open_sqlite_session",
]

SESSION_RUNNER = "gateway-session"
"""The runner id a session's rollout is held under (the gateway renews its lease)."""
SESSION_SPLIT = "session"
"""The split of sessions' tasks, so that training sources never mistake them for tasks."""


class SessionRequest(_Body):
    """Body of POST /store/sessions."""

    key: str = Field(min_length=1, max_length=512)
    """The session key (a client's session id, or a hash of its API key)."""
    lease_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    """Lease of the session's rollout; every call renews it."""


def session_task_id(key: str) -> str:
    """One task per session key (a key reopened after an idle finish gets a new rollout of
    the same task); hashed so any header value makes a short, safe id."""
    return "session-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def session_records(key: str, now: float) -> tuple[Task, Rollout]:
    """The session's task and its rollout, still queued: the backend moves it to running
    through its one transition function, in the same transaction that inserts it."""
    task = Task(id=session_task_id(key), input={"session": key}, split=SESSION_SPLIT)
    rollout = Rollout(
        id=uuid.uuid4().hex[:16],
        task_id=task.id,
        group_id=SESSION_SPLIT,
        max_attempts=1,
        created_at=now,
    )
    return task, rollout


def session_start(now: float, lease_s: float) -> dict[str, object]:
    """The changes that start a session's only attempt."""
    return {
        "attempt": 1,
        "runner_id": SESSION_RUNNER,
        "started_at": now,
        "lease_expires_at": now + lease_s,
    }


# Each backend's SQL, bound as its `open_session` method (so the backends stay small).


def open_sqlite_session(self: SqliteStore, key: str, lease_s: float = 600.0) -> Rollout:
    """SqliteStore.open_session: the task (kept if the key had one), its rollout inserted
    queued and started through `_transition`, in one IMMEDIATE transaction."""
    now = time.time()
    task, queued = session_records(key, now)
    with self._tx() as db:
        db.execute("INSERT INTO tasks VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING", task_row(task))
        db.execute(sqlite_schema.INSERT_ROLLOUT, rollout_row(queued))
        return self._transition(db, queued, RolloutStatus.running, **session_start(now, lease_s))


def open_postgres_session(self: PostgresStore, key: str, lease_s: float = 600.0) -> Rollout:
    """PostgresStore.open_session: the same records on the database's clock."""
    from tracerl.store import postgres_schema  # psycopg only with a PostgreSQL store

    with self._tx() as cur:
        now = self._now()
        task, queued = session_records(key, now)
        cur.execute(postgres_schema.INSERT_TASK, task_row(task))
        cur.execute(postgres_schema.INSERT_ROLLOUT, rollout_row(queued))
        start = [(queued, session_start(now, lease_s))]
        return self._transition(cur, start, RolloutStatus.running)[0]
