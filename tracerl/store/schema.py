"""The SQLite layout of the embedded store, and the codecs between rows and records.

Owns the table definitions (and the columns added since a table first shipped, so older
files open), the SQL statements derived from the records' fields, and the row <-> record
conversions. SqliteStore (sqlite.py) owns the connection and the transactions. The column
lists, the codecs and `rollouts_query` are shared with PostgresStore, whose tables have the
same columns.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

import orjson

from tracerl.store.packing import pack_floats, pack_ids, unpack_floats, unpack_ids
from tracerl.types import PolicyVersion, Reward, Rollout, RolloutStatus, Span, Task

__all__ = [
    "INSERT_REWARD",
    "INSERT_ROLLOUT",
    "INSERT_SPAN",
    "MUTABLE",
    "REWARD_COLS",
    "ROLLOUT_COLS",
    "SCHEMA",
    "SELECT_ROLLOUT",
    "SPAN_COLS",
    "TASK_COLS",
    "UPDATE_ROLLOUT",
    "add_missing_columns",
    "reward_from_row",
    "rollout_from_row",
    "rollout_row",
    "rollouts_query",
    "span_from_row",
    "span_row",
    "task_from_row",
    "task_row",
    "version_from_row",
    "with_seq",
]

SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY, input TEXT NOT NULL, answer TEXT NOT NULL, split TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS tasks_split ON tasks (split);
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY, task_id TEXT NOT NULL REFERENCES tasks (id), status TEXT NOT NULL,
    attempt INTEGER NOT NULL, max_attempts INTEGER NOT NULL, group_id TEXT, runner_id TEXT,
    lease_expires_at REAL, created_at REAL NOT NULL, started_at REAL, finished_at REAL,
    answer TEXT, reward REAL, error TEXT, assets TEXT, seed INTEGER);
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
    prefix_break TEXT, parent_span_id TEXT, latency_s REAL NOT NULL, created_at REAL NOT NULL,
    thread_id TEXT, parent_thread_id TEXT, assets TEXT NOT NULL DEFAULT '{}');
CREATE UNIQUE INDEX IF NOT EXISTS spans_order ON spans (rollout_id, attempt, seq);
CREATE TABLE IF NOT EXISTS rewards (
    rollout_id TEXT NOT NULL REFERENCES rollouts (id), attempt INTEGER NOT NULL,
    value REAL NOT NULL, span_seq INTEGER, role TEXT, name TEXT NOT NULL,
    created_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS rewards_attempt ON rewards (rollout_id, attempt);
CREATE TABLE IF NOT EXISTS versions (
    role TEXT NOT NULL, version INTEGER NOT NULL, path TEXT NOT NULL, created_at REAL NOT NULL,
    PRIMARY KEY (role, version));
CREATE TABLE IF NOT EXISTS assets (
    name TEXT NOT NULL, version INTEGER NOT NULL, text TEXT NOT NULL, note TEXT NOT NULL,
    candidate INTEGER NOT NULL, created_at REAL NOT NULL, PRIMARY KEY (name, version));
CREATE TABLE IF NOT EXISTS comparisons (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, created_at REAL NOT NULL, body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS comparisons_name ON comparisons (name, created_at);
CREATE TABLE IF NOT EXISTS optimizations (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, created_at REAL NOT NULL, body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS optimizations_name ON optimizations (name, created_at);
"""

# Column order equals field order of the records, so rows zip straight into them.
# (PostgresStore, postgres_schema.py, shares these and the codecs below.)
TASK_COLS = tuple(Task.model_fields)
ROLLOUT_COLS = tuple(Rollout.model_fields)
SPAN_COLS = tuple(Span.model_fields)
REWARD_COLS = tuple(Reward.model_fields)
SELECT_ROLLOUT = f"SELECT {', '.join(ROLLOUT_COLS)} FROM rollouts"
# What enqueue fixes (the task, the attempts allowed, the assets and seed) never changes.
MUTABLE = tuple(
    c for c in ROLLOUT_COLS if c not in ("id", "task_id", "max_attempts", "assets", "seed")
)
UPDATE_ROLLOUT = (
    f"UPDATE rollouts SET {', '.join(f'{c} = ?' for c in MUTABLE)} WHERE id = ? AND status = ?"
)
INSERT_ROLLOUT = (
    f"INSERT INTO rollouts ({', '.join(ROLLOUT_COLS)}) "
    f"VALUES ({', '.join('?' * len(ROLLOUT_COLS))})"
)
INSERT_SPAN = (
    f"INSERT INTO spans ({', '.join(SPAN_COLS)}) VALUES ({', '.join('?' * len(SPAN_COLS))})"
)
INSERT_REWARD = (
    f"INSERT INTO rewards ({', '.join(REWARD_COLS)}) VALUES ({', '.join('?' * len(REWARD_COLS))})"
)


_ADDED_COLUMNS = {
    "rewards": {"role": "TEXT"},
    "rollouts": {"assets": "TEXT", "seed": "INTEGER"},
    "spans": {
        "thread_id": "TEXT",
        "parent_thread_id": "TEXT",
        "assets": "TEXT NOT NULL DEFAULT '{}'",
    },
}
"""Columns added after a table was first shipped: files written before get them on open."""


def add_missing_columns(db: sqlite3.Connection) -> None:
    """Bring a file written by an older version up to SCHEMA (inside the opening tx)."""
    for table, columns in _ADDED_COLUMNS.items():
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        for name, kind in columns.items():
            if name not in have:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")


def _json(value: object) -> str:
    # Sorted keys: identical tasks serialize identically, so re-adding one is detected.
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def task_row(t: Task) -> tuple[str, str, str, str]:
    """A task as the tasks table stores it (JSON with sorted keys, so equal tasks match)."""
    return (t.id, _json(t.input), _json(t.answer), t.split)


def task_from_row(row: Sequence[object]) -> Task:
    """Inverse of task_row."""
    task_id, input_json, answer_json, split = row
    return Task(
        id=task_id,  # type: ignore[arg-type]
        input=orjson.loads(input_json),  # type: ignore[arg-type]
        answer=orjson.loads(answer_json),  # type: ignore[arg-type]
        split=split,  # type: ignore[arg-type]
    )


_ASSETS = ROLLOUT_COLS.index("assets")


def rollout_row(r: Rollout) -> list[object]:
    """A rollout as INSERT_ROLLOUT's values: its status as text, its assets as JSON."""
    values: list[object] = [getattr(r, c) for c in ROLLOUT_COLS]
    values[ROLLOUT_COLS.index("status")] = RolloutStatus(r.status).value
    values[_ASSETS] = None if r.assets is None else _json(r.assets)
    return values


def rollout_from_row(row: Sequence[object]) -> Rollout:
    """A rollouts row (selected as SELECT_ROLLOUT) as a record."""
    fields: dict[str, Any] = dict(zip(ROLLOUT_COLS, row, strict=True))
    if isinstance(fields["assets"], str):
        fields["assets"] = orjson.loads(fields["assets"])
    # Constructed, not validated: every row was a validated record when it was written, and
    # the gateway reads one per model call (validation cost as much as the query).
    fields["status"] = RolloutStatus(fields["status"])
    return Rollout.model_construct(**fields)


def span_row(s: Span) -> tuple[object, ...]:
    """A span as INSERT_SPAN's values: ids and log-probs packed, JSON as text."""
    return (
        s.id, s.rollout_id, s.attempt, s.seq, s.role, s.policy_version,
        pack_ids(s.prompt_ids), pack_ids(s.completion_ids), pack_floats(s.logprobs),
        # Key order kept (not _json): messages read back exactly as the agent sent them.
        orjson.dumps(s.messages).decode(), orjson.dumps(s.response).decode(),
        s.finish_reason, s.temperature, s.prefix_reused, s.prefix_break, s.parent_span_id, s.latency_s, s.created_at,
        s.thread_id, s.parent_thread_id, _json(s.assets),
    )  # fmt: skip


_SEQ = SPAN_COLS.index("seq")


def with_seq(row: tuple[object, ...], seq: int) -> tuple[object, ...]:
    """A span_row with its seq replaced (an appended span takes the one the store chose)."""
    return (*row[:_SEQ], seq, *row[_SEQ + 1 :])


def span_from_row(row: Sequence[object]) -> Span:
    """Inverse of span_row."""
    fields: dict[str, Any] = dict(zip(SPAN_COLS, row, strict=True))
    fields["prompt_ids"] = unpack_ids(fields["prompt_ids"])
    fields["completion_ids"] = unpack_ids(fields["completion_ids"])
    fields["logprobs"] = unpack_floats(fields["logprobs"])
    fields["messages"] = orjson.loads(fields["messages"])
    fields["response"] = orjson.loads(fields["response"])
    fields["assets"] = orjson.loads(fields["assets"])
    # Validated on the way in; re-validating thousands of ids per read would be waste.
    return Span.model_construct(**fields)


def reward_from_row(row: Sequence[object]) -> Reward:
    """A rewards row (its REWARD_COLS) as a record."""
    return Reward.model_validate(dict(zip(REWARD_COLS, row, strict=True)))


def version_from_row(row: Sequence[Any]) -> PolicyVersion:
    """A versions row (role, version, path, created_at) as a record."""
    return PolicyVersion(role=row[0], version=row[1], path=row[2], created_at=row[3])


def rollouts_query(
    mark: str,
    tiebreak: str,
    status: RolloutStatus | None,
    group_id: str | None,
    task_id: str | None,
    limit: int | None,
) -> tuple[str, list[object]]:
    """The SELECT and its arguments for `Store.rollouts`: the rollouts matching every filter
    given, oldest first. `mark` is the dialect's placeholder, `tiebreak` its insertion-order
    column."""
    status_value = None if status is None else RolloutStatus(status).value
    where: list[str] = []
    args: list[object] = []
    for col, val in (("status", status_value), ("group_id", group_id), ("task_id", task_id)):
        if val is not None:
            where.append(f"{col} = {mark}")
            args.append(val)
    sql = SELECT_ROLLOUT + (f" WHERE {' AND '.join(where)}" if where else "")
    sql += f" ORDER BY created_at, {tiebreak}"
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    return sql, args


SET_VERSION_PATH = "UPDATE versions SET path = ? WHERE role = ? AND version = ?"
"""A version served before its checkpoint existed gets the checkpoint's path once written."""
