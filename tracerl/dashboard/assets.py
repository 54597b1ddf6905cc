"""The dashboard's asset pages: a run's assets, each one's versions, the comparisons and
optimizations recorded for it, and its use: the rollouts that ran with each version (or
without it), by where they came from (a training run's groups, a comparison's arms, ...).

Read-only SQL on the run's traces.db, as queries.py (a `mode=ro` connection per call).
The use table reads every span once (which versions each rollout's calls saw): the asset
page loads when it is opened, never on the page's one-second poll. A store written before
assets existed has none.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from tracerl.assets.records import ASSET_NAME, Asset, Comparison, Optimization
from tracerl.store.assets import CURRENT_ALL, SELECT_ASSET, asset_from_row

__all__ = ["AssetList", "AssetPage", "AssetSummary", "ComparisonRow", "VersionUse"]


class _View(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AssetSummary(_View):
    """One asset in a run's store."""

    name: str
    """The asset."""
    current: int | None
    """Its current version (None: it has only candidates)."""
    versions: int
    """Versions in all, candidates included."""
    candidates: int
    """Of which an optimizer's candidates."""
    first_line: str
    """The current (else newest) version's first line."""


class AssetList(_View):
    """The assets of a run's store."""

    assets: list[AssetSummary]
    """By name."""


class ComparisonRow(_View):
    """A comparison without its pairs (the table row), and which pairs moved."""

    comparison: Comparison
    """The record, `pairs` holding only the discordant pairs (repairs and regressions)."""
    pairs: int
    """How many pairs it ran."""


class VersionUse(_View):
    """The rollouts that ran with one version (0: withheld), from one source."""

    version: int
    """The version its calls saw (0: the rollout withheld the asset)."""
    source: str
    """Where the rollouts came from: their group id's first part (a training run's name,
    "assets" for a comparison's arms, "proposer", ...)."""
    rollouts: int
    """Rollouts."""
    success: float | None
    """Share with a final reward >= 1 (None: none finished with a reward)."""
    mean_reward: float | None
    """Mean final reward of those with one."""


class AssetPage(_View):
    """Everything the dashboard shows of one asset."""

    versions: list[Asset]
    """Every version, oldest first."""
    comparisons: list[ComparisonRow]
    """Its comparisons, newest first."""
    optimizations: list[Optimization]
    """Its optimizations, newest first."""
    use: list[VersionUse]
    """Its rollouts by version and source."""


class AssetQueries:
    """Read-only asset queries over one traces.db."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=10.0)
        try:
            yield db
        finally:
            db.close()

    def _has_assets(self, db: sqlite3.Connection) -> bool:
        return bool(
            db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'assets'"
            ).fetchone()
        )

    def summaries(self) -> AssetList:
        """Every asset: current version, counts, first line."""
        with self._db() as db:
            if not self._has_assets(db):
                return AssetList(assets=[])
            current = {a.name: a for a in map(asset_from_row, db.execute(CURRENT_ALL))}
            counts = db.execute(
                "SELECT name, COUNT(*), SUM(candidate), MAX(version) FROM assets GROUP BY name ORDER BY name"
            ).fetchall()
            newest = {
                name: asset_from_row(
                    db.execute(
                        f"{SELECT_ASSET} WHERE name = ? AND version = ?", (name, top)
                    ).fetchone()
                )
                for name, _, _, top in counts
            }
        return AssetList(
            assets=[
                AssetSummary(
                    name=name,
                    current=current[name].version if name in current else None,
                    versions=n,
                    candidates=int(cands or 0),
                    first_line=_first_line((current.get(name) or newest[name]).text),
                )  # fmt: skip
                for name, n, cands, _ in counts
            ]
        )

    def page(self, name: str) -> AssetPage | None:
        """One asset's page (None: no such asset)."""
        with self._db() as db:
            if not self._has_assets(db):
                return None
            versions = [
                asset_from_row(r)
                for r in db.execute(f"{SELECT_ASSET} WHERE name = ? ORDER BY version", (name,))
            ]
            if not versions:
                return None
            comparisons = [Comparison.model_validate_json(b) for (b,) in db.execute(
                "SELECT body FROM comparisons WHERE name = ? ORDER BY created_at DESC", (name,))]  # fmt: skip
            optimizations = [Optimization.model_validate_json(b) for (b,) in db.execute(
                "SELECT body FROM optimizations WHERE name = ? ORDER BY created_at DESC", (name,))]  # fmt: skip
            use = self._use(db, name)
        return AssetPage(
            versions=versions, comparisons=[_row(c) for c in comparisons],
            optimizations=optimizations, use=use,
        )  # fmt: skip

    def _use(self, db: sqlite3.Connection, name: str) -> list[VersionUse]:
        """Rollouts by (version, source): the version their current attempt's calls saw,
        or 0 for those given the asset withheld."""
        path = f'$."{name}"'  # names are ASSET_NAME: no quotes to escape
        rows = db.execute(
            "WITH seen AS ("
            "  SELECT s.rollout_id AS id, MAX(json_extract(s.assets, ?1)) AS v FROM spans s"
            "  JOIN rollouts r ON r.id = s.rollout_id AND s.attempt = r.attempt"
            "  WHERE json_extract(s.assets, ?1) IS NOT NULL GROUP BY s.rollout_id"
            "  UNION ALL SELECT id, 0 FROM rollouts WHERE json_extract(assets, ?1) = 0) "
            "SELECT seen.v, r.group_id, r.reward FROM seen JOIN rollouts r ON r.id = seen.id",
            (path,),
        ).fetchall()
        groups: dict[tuple[int, str], list[float | None]] = {}
        for version, group, reward in rows:
            source = (group or "").split("/", 1)[0] or "(no group)"
            groups.setdefault((int(version), source), []).append(reward)
        out = []
        for (version, source), rewards in sorted(groups.items()):
            scored = [r for r in rewards if r is not None]
            out.append(
                VersionUse(
                    version=version,
                    source=source,
                    rollouts=len(rewards),
                    success=sum(r >= 1.0 for r in scored) / len(scored) if scored else None,
                    mean_reward=sum(scored) / len(scored) if scored else None,
                )  # fmt: skip
            )
        return out


def _first_line(text: str, width: int = 80) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def _row(c: Comparison) -> ComparisonRow:
    moved = [p for p in c.pairs if p.a != p.b]
    return ComparisonRow(comparison=c.model_copy(update={"pairs": moved}), pairs=len(c.pairs))


def install_asset_routes(
    app: FastAPI, store_of: Callable[[str], Path], error: Callable[..., Exception]
) -> None:
    """GET /api/runs/<run>/assets and /api/runs/<run>/assets/<name>. `store_of(run)` is the
    run's traces.db (it raises for an unknown run or one without a store); `error(status,
    message, type)` is the app's refusal."""

    @app.get("/api/runs/{run}/assets")
    def assets(run: str) -> AssetList:
        return AssetQueries(store_of(run)).summaries()

    @app.get("/api/runs/{run}/assets/{name}")
    def asset(run: str, name: str) -> AssetPage:
        if not re.match(ASSET_NAME, name):
            raise error(400, f"{name!r} is not an asset name ({ASSET_NAME})", "invalid_request")
        page = AssetQueries(store_of(run)).page(name)
        if page is None:
            raise error(404, f"no asset {name!r} in run {run!r}", "not_found")
        return page
