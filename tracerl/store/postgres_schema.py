"""The PostgreSQL layout of the store, its migrations, and the statements PostgresStore runs.

The tables mirror schema.py's SQLite ones column for column, so the same row codecs serve
both; the differences are Postgres's own: times and rewards are DOUBLE PRECISION (REAL is 4
bytes there), token ids BYTEA, and an identity column `seq` gives tasks, rollouts and
rewards the insertion order SQLite's rowid gives. A database records which migrations it
has had in `schema_version`; `migrate` applies the missing ones, under an advisory lock so
that several processes opening the store at once do not race.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import psycopg

from tracerl.store import StoreError
from tracerl.store.schema import MUTABLE, REWARD_COLS, ROLLOUT_COLS, SPAN_COLS, TASK_COLS
from tracerl.types import RolloutStatus

__all__ = [
    "ASSET_LOCK",
    "CLAIMABLE",
    "DB_NOW",
    "EXPIRED",
    "INSERT_REWARD",
    "INSERT_ROLLOUT",
    "INSERT_SPAN",
    "INSERT_TASK",
    "INSERT_VERSION",
    "ISSUE_LOCK",
    "LATEST_VERSION",
    "MAX_SEQ",
    "MAX_VERSION",
    "MIGRATIONS",
    "SELECT_REWARDS",
    "SELECT_ROLLOUT",
    "SELECT_SPANS",
    "SELECT_TASK",
    "UPDATE_ROLLOUT",
    "SET_VERSION_PATH_PG",
    "VERSION_PATH",
    "migrate",
    "schema_version",
]

_STATUSES = ", ".join(f"'{s.value}'" for s in RolloutStatus)

MIGRATIONS: tuple[str, ...] = (
    f"""
CREATE TABLE tasks (
    seq BIGINT GENERATED ALWAYS AS IDENTITY, id TEXT PRIMARY KEY, input TEXT NOT NULL,
    answer TEXT NOT NULL, split TEXT NOT NULL);
CREATE INDEX tasks_split ON tasks (split, seq);
CREATE TABLE rollouts (
    seq BIGINT GENERATED ALWAYS AS IDENTITY, id TEXT PRIMARY KEY,
    task_id TEXT NOT NULL REFERENCES tasks (id),
    status TEXT NOT NULL CHECK (status IN ({_STATUSES})),
    attempt INTEGER NOT NULL, max_attempts INTEGER NOT NULL, group_id TEXT, runner_id TEXT,
    lease_expires_at DOUBLE PRECISION, created_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION, finished_at DOUBLE PRECISION, answer TEXT,
    reward DOUBLE PRECISION, error TEXT);
CREATE INDEX rollouts_claim ON rollouts (created_at, seq) WHERE status = 'queued';
CREATE INDEX rollouts_lease ON rollouts (lease_expires_at) WHERE status = 'running';
CREATE INDEX rollouts_status ON rollouts (status, created_at, seq);
CREATE INDEX rollouts_group ON rollouts (group_id);
CREATE INDEX rollouts_task ON rollouts (task_id);
CREATE TABLE spans (
    id TEXT PRIMARY KEY, rollout_id TEXT NOT NULL REFERENCES rollouts (id),
    attempt INTEGER NOT NULL, seq INTEGER NOT NULL, role TEXT NOT NULL,
    policy_version INTEGER NOT NULL, prompt_ids BYTEA NOT NULL, completion_ids BYTEA NOT NULL,
    logprobs BYTEA NOT NULL, messages TEXT NOT NULL, response TEXT NOT NULL,
    finish_reason TEXT NOT NULL, temperature DOUBLE PRECISION NOT NULL,
    prefix_reused INTEGER NOT NULL, prefix_break TEXT, parent_span_id TEXT,
    latency_s DOUBLE PRECISION NOT NULL, created_at DOUBLE PRECISION NOT NULL);
CREATE UNIQUE INDEX spans_order ON spans (rollout_id, attempt, seq);
CREATE TABLE rewards (
    seq BIGINT GENERATED ALWAYS AS IDENTITY,
    rollout_id TEXT NOT NULL REFERENCES rollouts (id), attempt INTEGER NOT NULL,
    value DOUBLE PRECISION NOT NULL, span_seq INTEGER, role TEXT, name TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL);
CREATE INDEX rewards_attempt ON rewards (rollout_id, attempt, seq);
CREATE TABLE versions (
    role TEXT NOT NULL, version INTEGER NOT NULL, path TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (role, version));
""",
    # 2: the conversation (thread) of each span, and the thread it branched from.
    "ALTER TABLE spans ADD COLUMN thread_id TEXT, ADD COLUMN parent_thread_id TEXT;",
    # 3: assets (versioned texts), their comparisons and optimizations; the asset versions
    # each rollout was given and each span saw, and a rollout's sampling seed.
    """
CREATE TABLE assets (
    name TEXT NOT NULL, version INTEGER NOT NULL, text TEXT NOT NULL, note TEXT NOT NULL,
    candidate BOOLEAN NOT NULL, created_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (name, version));
CREATE TABLE comparisons (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
    body TEXT NOT NULL);
CREATE INDEX comparisons_name ON comparisons (name, created_at);
CREATE TABLE optimizations (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
    body TEXT NOT NULL);
CREATE INDEX optimizations_name ON optimizations (name, created_at);
ALTER TABLE rollouts ADD COLUMN assets TEXT, ADD COLUMN seed BIGINT;
ALTER TABLE spans ADD COLUMN assets TEXT NOT NULL DEFAULT '{}';
""",
)
"""Each entry takes the schema one version up; append, never edit a shipped one."""

_LOCK_KEY = 0x7472616365726C  # "tracerl": one advisory lock id for every migrating process


def _insert(table: str, cols: Sequence[str]) -> str:
    return f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join(['%s'] * len(cols))})"


SELECT_ROLLOUT = f"SELECT {', '.join(ROLLOUT_COLS)} FROM rollouts"
SELECT_TASK = f"SELECT {', '.join(TASK_COLS)} FROM tasks"
SELECT_SPANS = (
    f"SELECT {', '.join(SPAN_COLS)} FROM spans WHERE rollout_id = %s AND attempt = %s ORDER BY seq"
)
SELECT_REWARDS = (
    f"SELECT {', '.join(REWARD_COLS)} FROM rewards "
    "WHERE rollout_id = %s AND attempt = %s ORDER BY seq"
)
UPDATE_ROLLOUT = (
    f"UPDATE rollouts SET {', '.join(f'{c} = %s' for c in MUTABLE)} WHERE id = %s AND status = %s"
)
INSERT_TASK = _insert("tasks", TASK_COLS) + " ON CONFLICT (id) DO NOTHING"
INSERT_ROLLOUT = _insert("rollouts", ROLLOUT_COLS)
INSERT_SPAN = _insert("spans", SPAN_COLS)
INSERT_REWARD = _insert("rewards", REWARD_COLS)
INSERT_VERSION = "INSERT INTO versions VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING"
VERSION_PATH = "SELECT path FROM versions WHERE role = %s AND version = %s"
SET_VERSION_PATH_PG = "UPDATE versions SET path = %s WHERE role = %s AND version = %s"
LATEST_VERSION = (
    "SELECT role, version, path, created_at FROM versions WHERE role = %s "
    "ORDER BY version DESC LIMIT 1"
)
MAX_VERSION = "SELECT max(version) FROM versions WHERE role = ANY(%s)"
MAX_SEQ = "SELECT max(seq) FROM spans WHERE rollout_id = %s AND attempt = %s"
_ISSUE_KEY = 0x74726163657276  # "tracerv": issuers of policy versions, not migrations
ISSUE_LOCK = f"SELECT pg_advisory_xact_lock({_ISSUE_KEY})"
_ASSET_KEY = 0x74726163657261  # "tracera": puts of asset versions
ASSET_LOCK = f"SELECT pg_advisory_xact_lock({_ASSET_KEY})"
DB_NOW = "SELECT extract(epoch FROM clock_timestamp())::float8"
# SKIP LOCKED: concurrent claimers pass over rows another transaction holds instead of
# queueing behind it, so each takes the next free rollouts and none gets one twice.
CLAIMABLE = (
    f"{SELECT_ROLLOUT} WHERE status = 'queued' ORDER BY created_at, seq LIMIT %s "
    "FOR UPDATE SKIP LOCKED"
)
EXPIRED = (
    f"{SELECT_ROLLOUT} WHERE status = 'running' AND lease_expires_at < %s ORDER BY seq "
    "FOR UPDATE SKIP LOCKED"
)


def schema_version(conn: psycopg.Connection[Any]) -> int:
    """How many migrations the database has had (0 for an empty one)."""
    exists = conn.execute("SELECT to_regclass('schema_version') IS NOT NULL").fetchone()
    if not exists or not exists[0]:
        return 0
    row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
    return int(row[0] or 0) if row else 0


def migrate(conn: psycopg.Connection[Any], migrations: Sequence[str] = MIGRATIONS) -> int:
    """Apply the migrations the database lacks, all in one transaction; its version after.

    Idempotent: a database already at the latest version is left alone. One that is newer
    than this code (written by a later tracerl) is refused rather than misread.
    """
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_version "
            "(version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
        )
        have = schema_version(conn)
        if have > len(migrations):
            raise StoreError(
                f"the database is at schema version {have}; this tracerl knows only "
                f"{len(migrations)}: upgrade tracerl"
            )
        for version, sql in enumerate(migrations[have:], start=have + 1):
            conn.execute(sql)  # no parameters, so several statements may run in one call
            conn.execute("INSERT INTO schema_version VALUES (%s, %s)", (version, time.time()))
    return len(migrations)
