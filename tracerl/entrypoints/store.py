"""`tracerl store migrate --from runs/x/traces.db --to postgresql://...`: move a run's store.

The configs are here, beside the entry point, and import nothing heavy (the CLI reads them
for --help); the copy itself (tracerl/store/migrate.py) loads only when the command runs.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import CliSubCommand
from rich.console import Console

from tracerl.entrypoints.config import Command

__all__ = ["StoreCommand", "StoreMigrateCommand", "main"]


class StoreMigrateCommand(Command):
    """Copy a SQLite store (tasks, rollouts of every status, spans and rewards of every
    attempt, policy versions) into PostgreSQL. Re-running copies only what is missing."""

    source: str = Field(alias="from")
    """The SQLite store file to copy (e.g. runs/my_run/traces.db)."""
    to: str
    """The PostgreSQL database to copy into (postgresql://user@host:port/db)."""
    batch: int = Field(default=500, ge=1)
    """Rollouts (with their spans and rewards) per transaction."""


class StoreCommand(Command):
    """Manage stores."""

    migrate: CliSubCommand[StoreMigrateCommand]
    """Copy a SQLite store into PostgreSQL."""


def main(cfg: StoreCommand, console: Console) -> None:
    """Run the copy and print what it added (SystemExit for a missing file or a bad URL)."""
    from tracerl.store.migrate import copy_sqlite_to_postgres
    from tracerl.store.open import is_postgres_url

    m = cfg.migrate
    assert m is not None  # the parser requires the subcommand
    if not is_postgres_url(m.to):
        raise SystemExit(f"--to must be a postgresql:// URL, not {m.to!r}")
    try:
        report = copy_sqlite_to_postgres(m.source, m.to, m.batch)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    added = ", ".join(f"{n} {name}" for name, n in report.model_dump().items())
    console.print(f"copied {m.source} -> {m.to.split('@')[-1]}: added {added}")
