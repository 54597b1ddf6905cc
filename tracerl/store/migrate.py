"""Copying a run's SQLite store into PostgreSQL: `tracerl store migrate --from F --to URL`.

Rows move as they are stored: the same columns on both sides (schema.py's column lists),
token ids still packed, every attempt's spans and rewards, statuses and times untouched, so
the copy reads back exactly as the file did. Rollouts go in batches, each batch with its
spans and rewards in one transaction, in the file's order (so both list them alike).

Assets, comparisons and optimizations are copied as they are (versions keep their numbers).

Idempotent: a rollout already at the destination is skipped with its spans and rewards
(they arrived in the same transaction), as are tasks and versions already there; re-running
after an interruption copies what is missing and nothing twice. A task or version present
at both with different content is a Conflict: the two stores hold different runs.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
from pydantic import BaseModel, ConfigDict

from tracerl.store import Conflict
from tracerl.store.assets import ASSET_COLS, asset_from_row
from tracerl.store.postgres_schema import (
    INSERT_REWARD,
    INSERT_ROLLOUT,
    INSERT_SPAN,
    INSERT_TASK,
    INSERT_VERSION,
    SELECT_TASK,
    migrate,
)
from tracerl.store.schema import REWARD_COLS, ROLLOUT_COLS, SPAN_COLS, TASK_COLS
from tracerl.store.sqlite import SqliteStore

__all__ = ["CopyReport", "copy_sqlite_to_postgres"]

VERSION_COLS = ("role", "version", "path", "created_at")


class CopyReport(BaseModel):
    """What one copy added to the destination (rows already there are not counted)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    tasks: int = 0
    """Tasks added."""
    rollouts: int = 0
    """Rollouts added (every status, every attempt count)."""
    spans: int = 0
    """Spans added, of every attempt."""
    rewards: int = 0
    """Rewards added, of every attempt."""
    versions: int = 0
    """Policy versions added."""
    assets: int = 0
    """Asset versions added."""
    comparisons: int = 0
    """Comparisons added."""
    optimizations: int = 0
    """Optimizations added."""


def copy_sqlite_to_postgres(source: str | Path, url: str, batch: int = 500) -> CopyReport:
    """Copy everything in the SQLite file `source` into the database at `url` (its schema
    created or brought up to date first); `batch` rollouts per transaction."""
    if not Path(source).is_file():
        raise FileNotFoundError(f"no store file at {source}")
    SqliteStore(source).close()  # brings a file written by an older tracerl up to date
    src = sqlite3.connect(f"file:{Path(source).resolve()}?mode=ro", uri=True)
    try:
        with psycopg.connect(url, autocommit=True) as dst:
            migrate(dst)
            tasks, versions = _copy_tasks(src, dst), _copy_versions(src, dst)
            assets = _copy_assets(src, dst)
            records = {t: _copy_records(src, dst, t) for t in ("comparisons", "optimizations")}
            rollouts = spans = rewards = 0
            for ids in _batches(src, batch):
                added = _copy_rollouts(src, dst, ids)
                rollouts += added[0]
                spans += added[1]
                rewards += added[2]
    finally:
        src.close()
    return CopyReport(
        tasks=tasks, rollouts=rollouts, spans=spans, rewards=rewards, versions=versions,
        assets=assets, **records,
    )  # fmt: skip


def _select(table: str, cols: Sequence[str], where: str = "") -> str:
    return f"SELECT {', '.join(cols)} FROM {table} {where} ORDER BY rowid"


def _batches(src: sqlite3.Connection, size: int) -> Iterator[list[str]]:
    """Rollout ids in the file's order, `size` at a time."""
    cur = src.execute(_select("rollouts", ["id"]))
    while rows := cur.fetchmany(size):
        yield [r[0] for r in rows]


def _copy_tasks(src: sqlite3.Connection, dst: psycopg.Connection[Any]) -> int:
    rows = src.execute(_select("tasks", TASK_COLS)).fetchall()
    with dst.transaction(), dst.cursor() as cur:
        before = _count(cur, "tasks")
        cur.executemany(INSERT_TASK, rows)
        ids = [row[0] for row in rows]
        stored = {r[0]: tuple(r) for r in cur.execute(f"{SELECT_TASK} WHERE id = ANY(%s)", (ids,))}
        if changed := [row[0] for row in rows if stored[row[0]] != tuple(row)]:
            raise Conflict(f"task {changed[0]!r} is at the destination with different content")
        return _count(cur, "tasks") - before


def _copy_versions(src: sqlite3.Connection, dst: psycopg.Connection[Any]) -> int:
    rows = src.execute(_select("versions", VERSION_COLS)).fetchall()
    with dst.transaction(), dst.cursor() as cur:
        before = _count(cur, "versions")
        cur.executemany(INSERT_VERSION, rows)
        stored = {
            (r[0], r[1]): r[2] for r in cur.execute("SELECT role, version, path FROM versions")
        }
        if changed := [r for r in rows if stored[(r[0], r[1])] != r[2]]:
            raise Conflict(f"{changed[0][0]} version {changed[0][1]} differs at the destination")
        return _count(cur, "versions") - before


def _copy_assets(src: sqlite3.Connection, dst: psycopg.Connection[Any]) -> int:
    """Asset versions, through their records (SQLite keeps `candidate` as 0/1)."""
    found = [asset_from_row(r) for r in src.execute(_select("assets", ASSET_COLS))]
    rows = [tuple(getattr(a, c) for c in ASSET_COLS) for a in found]
    marks = ", ".join(["%s"] * len(ASSET_COLS))
    with dst.transaction(), dst.cursor() as cur:
        before = _count(cur, "assets")
        cur.executemany(f"INSERT INTO assets VALUES ({marks}) ON CONFLICT DO NOTHING", rows)
        stored = {
            (r[0], r[1]): tuple(r)
            for r in cur.execute(f"SELECT {', '.join(ASSET_COLS)} FROM assets")
        }
        if changed := [r for r in rows if stored[(r[0], r[1])] != r]:
            raise Conflict(
                f"asset {changed[0][0]} version {changed[0][1]} differs at the destination"
            )
        return _count(cur, "assets") - before


def _copy_records(src: sqlite3.Connection, dst: psycopg.Connection[Any], table: str) -> int:
    """Comparisons or optimizations (JSON under an id), each at most once."""
    rows = src.execute(_select(table, ("id", "name", "created_at", "body"))).fetchall()
    with dst.transaction(), dst.cursor() as cur:
        before = _count(cur, table)
        cur.executemany(f"INSERT INTO {table} VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING", rows)
        stored = dict(cur.execute(f"SELECT id, body FROM {table}").fetchall())
        if changed := [r[0] for r in rows if stored[r[0]] != r[3]]:
            raise Conflict(f"{table[:-1]} {changed[0]!r} differs at the destination")
        return _count(cur, table) - before


def _copy_rollouts(
    src: sqlite3.Connection, dst: psycopg.Connection[Any], ids: list[str]
) -> tuple[int, int, int]:
    """One batch of rollouts, with the spans and rewards of those not yet at the destination,
    in one transaction; how many rollouts, spans and rewards it added."""
    with dst.transaction(), dst.cursor() as cur:
        present = {r[0] for r in cur.execute("SELECT id FROM rollouts WHERE id = ANY(%s)", (ids,))}
        new = [i for i in ids if i not in present]
        if not new:
            return 0, 0, 0
        marks = ", ".join("?" * len(new))
        where = f"WHERE rollout_id IN ({marks})"
        rollouts = src.execute(_select("rollouts", ROLLOUT_COLS, f"WHERE id IN ({marks})"), new)
        spans = src.execute(_select("spans", SPAN_COLS, where), new).fetchall()
        rewards = src.execute(_select("rewards", REWARD_COLS, where), new).fetchall()
        cur.executemany(INSERT_ROLLOUT, rollouts.fetchall())
        cur.executemany(INSERT_SPAN, spans)
        cur.executemany(INSERT_REWARD, rewards)
        return len(new), len(spans), len(rewards)


def _count(cur: psycopg.Cursor[Any], table: str) -> int:
    row = cur.execute(f"SELECT count(*) FROM {table}").fetchone()
    return int(row[0]) if row else 0
