"""The store's asset tables: versioned texts, comparisons and optimizations, in SQL that both
back ends run (SqliteStore and PostgresStore inherit `SqlAssets`, each with its dialect).

Versions are numbered by the store, one above the name's highest, inside the write
transaction (SQLite's IMMEDIATE transactions take turns; PostgreSQL's hold an advisory
lock), so two puts of one name never get the same number. A version is never changed or
deleted. Comparisons and optimizations are stored as their JSON under their id: a
comparison is written once (the same id again must carry the same record), an optimization
is rewritten after each of its rounds, so a dashboard sees it as it goes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from tracerl.assets.records import Asset, Comparison, Optimization
from tracerl.store import Conflict, NotFound

__all__ = ["ASSET_COLS", "AssetSql", "SqlAssets", "asset_from_row"]

ASSET_COLS = tuple(Asset.model_fields)
"""The assets table's columns, in the record's field order."""


@dataclass(frozen=True)
class AssetSql:
    """One dialect's statements for the asset tables."""

    mark: str
    """The placeholder: '?' (SQLite) or '%s' (PostgreSQL)."""
    lock: str | None = None
    """What a put runs first to take turns with other puts (None: the transaction does)."""

    def q(self, sql: str) -> str:
        """`sql` written with '?' placeholders, in this dialect."""
        return sql.replace("?", self.mark)


SELECT_ASSET = f"SELECT {', '.join(ASSET_COLS)} FROM assets"
CURRENT = f"{SELECT_ASSET} WHERE name = ? AND NOT candidate ORDER BY version DESC LIMIT 1"
CURRENT_ALL = (
    f"SELECT {', '.join(f'a.{c}' for c in ASSET_COLS)} FROM assets a JOIN "
    "(SELECT name, MAX(version) AS top FROM assets WHERE NOT candidate GROUP BY name) m "
    "ON a.name = m.name AND a.version = m.top ORDER BY a.name"
)


def asset_from_row(row: Sequence[object]) -> Asset:
    """An assets row (its ASSET_COLS) as a record."""
    return Asset.model_validate(dict(zip(ASSET_COLS, row, strict=True)))


class SqlAssets:
    """The Store protocol's asset methods, over `_tx` and `_read` of the store inheriting it
    (each a connection or cursor with `execute`)."""

    _assets_sql: ClassVar[AssetSql]

    if TYPE_CHECKING:

        def _tx(self) -> AbstractContextManager[Any]: ...

        def _read(self) -> AbstractContextManager[Any]: ...

    def put_asset(self, name: str, text: str, note: str = "", candidate: bool = False) -> Asset:
        """Store `text` as the next version of `name` (1 for a new name); a plain version
        becomes the current one, a candidate never does."""
        draft = Asset(name=name, version=1, text=text, note=note, candidate=candidate)
        q = self._assets_sql.q
        with self._tx() as db:
            if self._assets_sql.lock:
                db.execute(self._assets_sql.lock)
            (top,) = db.execute(
                q("SELECT MAX(version) FROM assets WHERE name = ?"), (name,)
            ).fetchone()
            asset = draft.model_copy(update={"version": (top or 0) + 1, "created_at": time.time()})
            values = [getattr(asset, c) for c in ASSET_COLS]
            marks = ", ".join("?" * len(ASSET_COLS))
            db.execute(q(f"INSERT INTO assets ({', '.join(ASSET_COLS)}) VALUES ({marks})"), values)
        return asset

    def asset(self, name: str, version: int | None = None) -> Asset:
        """One version of `name`, or its current one (its newest that is not a candidate);
        NotFound saying which is missing."""
        q = self._assets_sql.q
        with self._read() as db:
            if version is None:
                row = db.execute(q(CURRENT), (name,)).fetchone()
            else:
                row = db.execute(
                    q(f"{SELECT_ASSET} WHERE name = ? AND version = ?"), (name, version)
                ).fetchone()
            known = (
                row is not None
                or db.execute(q("SELECT 1 FROM assets WHERE name = ? LIMIT 1"), (name,)).fetchone()
            )
        if row is not None:
            return asset_from_row(row)
        if not known:
            raise NotFound(f"no asset {name!r}")
        if version is None:
            raise NotFound(f"asset {name!r} has only candidates: no current version")
        raise NotFound(f"asset {name!r} has no version {version}")

    def assets(self) -> list[Asset]:
        """The current version of every asset that has one, by name."""
        with self._read() as db:
            rows = db.execute(CURRENT_ALL).fetchall()
        return [asset_from_row(r) for r in rows]

    def asset_versions(self, name: str) -> list[Asset]:
        """Every version of `name`, candidates included, oldest first (NotFound: none)."""
        q = self._assets_sql.q
        with self._read() as db:
            rows = db.execute(q(f"{SELECT_ASSET} WHERE name = ? ORDER BY version"), (name,))
            found = [asset_from_row(r) for r in rows.fetchall()]
        if not found:
            raise NotFound(f"no asset {name!r}")
        return found

    def add_comparison(self, comparison: Comparison) -> None:
        """Record a comparison; the same id again is a no-op if identical, else Conflict."""
        body = comparison.model_dump_json()
        q = self._assets_sql.q
        with self._tx() as db:
            db.execute(
                q("INSERT INTO comparisons VALUES (?, ?, ?, ?) ON CONFLICT (id) DO NOTHING"),
                (comparison.id, comparison.name, comparison.created_at, body),
            )
            (stored,) = db.execute(
                q("SELECT body FROM comparisons WHERE id = ?"), (comparison.id,)
            ).fetchone()
        if Comparison.model_validate_json(stored) != comparison:
            raise Conflict(f"comparison {comparison.id!r} is recorded with different content")

    def comparisons(self, name: str | None = None) -> list[Comparison]:
        """Comparisons (of one asset), oldest first."""
        return [Comparison.model_validate_json(b) for b in self._bodies("comparisons", name)]

    def put_optimization(self, optimization: Optimization) -> None:
        """Record an optimization, replacing what its id held (it is rewritten each round);
        Conflict if that id belongs to another asset's optimization."""
        q = self._assets_sql.q
        with self._tx() as db:
            db.execute(
                q(
                    "INSERT INTO optimizations VALUES (?, ?, ?, ?) ON CONFLICT (id) "
                    "DO UPDATE SET body = excluded.body WHERE optimizations.name = excluded.name"
                ),
                (optimization.id, optimization.name, optimization.created_at,
                 optimization.model_dump_json()),
            )  # fmt: skip
            (name,) = db.execute(
                q("SELECT name FROM optimizations WHERE id = ?"), (optimization.id,)
            ).fetchone()
        if name != optimization.name:
            raise Conflict(f"optimization {optimization.id!r} belongs to asset {name!r}")

    def optimizations(self, name: str | None = None) -> list[Optimization]:
        """Optimizations (of one asset), oldest first."""
        return [Optimization.model_validate_json(b) for b in self._bodies("optimizations", name)]

    def _bodies(self, table: str, name: str | None) -> list[str]:
        q = self._assets_sql.q
        where = "" if name is None else " WHERE name = ?"
        with self._read() as db:
            rows = db.execute(
                q(f"SELECT body FROM {table}{where} ORDER BY created_at, id"),
                () if name is None else (name,),
            ).fetchall()
        return [r[0] for r in rows]
