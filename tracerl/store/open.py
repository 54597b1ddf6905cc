"""Opening the store a config names: a PostgreSQL database, a store API, or a SQLite file.

`open_store` is what a process calls with its configured `store` target: a
`postgresql://` (or `postgres://`) URL opens a PostgresStore shared with other machines;
anything else goes to `connect` (an http(s):// store API, else a SQLite file or
":memory:"). psycopg is imported only when a Postgres URL is given.
"""

from __future__ import annotations

from pathlib import Path

from tracerl.store import Store, connect

__all__ = ["is_postgres_url", "open_store"]


def is_postgres_url(target: str | Path) -> bool:
    """Whether a store target names a PostgreSQL database."""
    return str(target).startswith(("postgresql://", "postgres://"))


def open_store(target: str | Path = ":memory:") -> Store:
    """A PostgresStore for a postgresql:// URL, else what `connect` gives for the target."""
    if is_postgres_url(target):
        from tracerl.store.postgres import PostgresStore

        return PostgresStore(str(target))
    return connect(target)
