"""Assets in the store: versions numbered per name, the current one, candidates, the asset
versions rollouts are given and spans saw, comparisons and optimizations; on SQLite, over
HTTP and on PostgreSQL (the `store` fixture of test_store.py), and in stores written before
assets existed (SQLite files opened again, PostgreSQL databases migrated, copies)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.pg import pg_server, pg_url  # noqa: F401  (fixtures)
from tests.test_store import server, span, store, tasks  # noqa: F401  (fixtures)
from tracerl.assets.records import Comparison, Optimization, Pair
from tracerl.server import serving
from tracerl.store import Conflict, NotFound, SqliteStore, Store
from tracerl.store.http import create_store_app
from tracerl.types import RolloutStatus


def test_versions_rise_per_name_and_candidates_are_never_current(store: Store) -> None:  # noqa: F811
    a1 = store.put_asset("format", "Answer with the number only.", note="first")
    b1 = store.put_asset("style", "Be brief.")
    cand = store.put_asset("format", "Answer with digits.", candidate=True)
    assert (a1.version, b1.version, cand.version) == (1, 1, 2)
    assert store.asset("format").version == 1  # the candidate is newer but not current
    a3 = store.put_asset("format", "Answer with digits only.")
    assert store.asset("format") == a3 and a3.version == 3
    assert store.asset("format", 2) == cand and cand.candidate
    assert store.asset("format", 1).note == "first"
    assert [a.version for a in store.asset_versions("format")] == [1, 2, 3]
    assert [(a.name, a.version) for a in store.assets()] == [("format", 3), ("style", 1)]


def test_missing_assets_say_what_is_missing(store: Store) -> None:  # noqa: F811
    with pytest.raises(NotFound, match="no asset 'nope'"):
        store.asset("nope")
    with pytest.raises(NotFound, match="no asset"):
        store.asset_versions("nope")
    store.put_asset("only", "a candidate", candidate=True)
    with pytest.raises(NotFound, match="only candidates"):
        store.asset("only")
    assert store.assets() == []
    store.put_asset("x", "text")
    with pytest.raises(NotFound, match="no version 7"):
        store.asset("x", 7)


def test_rollouts_carry_their_assets_and_seeds(store: Store) -> None:  # noqa: F811
    store.add_tasks(tasks(2))
    with_asset = store.enqueue(["t0", "t1"], "g", assets={"format": 2}, seeds=[11, 12])
    without = store.enqueue(["t0"], "g", assets={"format": 0})
    plain = store.enqueue(["t1"], "g")
    assert [(r.assets, r.seed) for r in with_asset] == [({"format": 2}, 11), ({"format": 2}, 12)]
    assert (without[0].assets, without[0].seed, plain[0].assets) == ({"format": 0}, None, None)
    stored = {r.id: r for r in store.rollouts(group_id="g")}
    assert stored[with_asset[1].id].seed == 12 and stored[without[0].id].assets == {"format": 0}
    claimed = store.claim("r", n=4)
    assert {r.id: r.assets for r in claimed} == {r.id: r.assets for r in stored.values()}
    # A finish changes what it changes and nothing enqueue fixed.
    done = store.finish(claimed[0].id, 1, RolloutStatus.succeeded, reward=1.0)
    assert (done.assets, done.seed) == (stored[done.id].assets, stored[done.id].seed)
    with pytest.raises(ValueError, match="seeds"):
        store.enqueue(["t0", "t1"], seeds=[1])


def test_spans_keep_the_asset_versions_they_saw(store: Store) -> None:  # noqa: F811
    store.add_tasks(tasks(1))
    store.enqueue(["t0"])
    (r,) = store.claim("r")
    seen = span(r, 0).model_copy(update={"assets": {"format": 3, "style": 1}})
    store.add_spans([seen, span(r, 1)])
    first, second = store.spans(r.id)
    assert first.assets == {"format": 3, "style": 1} and second.assets == {}


def _comparison(cid: str = "c1", p: float = 0.25) -> Comparison:
    pairs = [
        Pair(task_id="t0", repeat=0, a=False, b=True, rollout_a="ra0", rollout_b="rb0"),
        Pair(task_id="t1", repeat=0, a=True, b=True, rollout_a="ra1", rollout_b="rb1"),
    ]
    return Comparison(
        id=cid, name="format", a=1, b=2, pairs=pairs, success_a=0.5, success_b=1.0,
        repairs=1, regressions=0, p_value=p, created_at=1.0,
    )  # fmt: skip


def test_comparisons_are_kept_once_and_optimizations_as_they_go(store: Store) -> None:  # noqa: F811
    store.add_comparison(_comparison())
    store.add_comparison(_comparison())  # identical: a no-op
    with pytest.raises(Conflict):
        store.add_comparison(_comparison(p=0.5))
    other = _comparison("c2").model_copy(update={"name": "style"})
    store.add_comparison(other)
    assert [c.id for c in store.comparisons()] == ["c1", "c2"]
    assert store.comparisons("format") == [_comparison()]
    running = Optimization(id="o1", name="format", seed=1, proposer="bootstrap")
    store.put_optimization(running)
    done = running.model_copy(update={"status": "accepted", "accepted": 4, "p_value": 0.01})
    store.put_optimization(done)
    assert store.optimizations("format") == [done] and store.optimizations("style") == []
    with pytest.raises(Conflict):
        store.put_optimization(done.model_copy(update={"name": "style"}))


def test_concurrent_puts_never_share_a_version(store: Store) -> None:  # noqa: F811
    got: list[int] = []

    def put(i: int) -> None:
        for j in range(5):
            got.append(store.put_asset("shared", f"text {i}.{j}").version)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(1, 21))


def test_the_http_api_refuses_bad_asset_requests_with_json(tmp_path: Path) -> None:
    backend = SqliteStore(tmp_path / "s.db")
    with serving(create_store_app(backend)) as url:
        bad = [
            ("POST", "/store/assets", {"name": "a@1", "text": "x"}),
            ("POST", "/store/assets", {"name": "a", "text": ""}),
            ("POST", "/store/rollouts", {"task_ids": ["t0"], "seeds": [1, 2]}),
            ("POST", "/store/rollouts", {"task_ids": ["t0"], "assets": {"a": -1}}),
            ("POST", "/store/rollouts", {"task_ids": ["t0"], "seeds": [2**62]}),
        ]
        for method, path, body in bad:
            resp = httpx.request(method, url + path, json=body)
            assert resp.status_code == 422, (path, body, resp.text)
            assert resp.json()["error"]["message"]
        missing = httpx.get(f"{url}/store/assets/nope")
        assert missing.status_code == 404 and "no asset" in missing.json()["error"]["message"]
        bad_version = httpx.get(f"{url}/store/assets/nope", params={"version": 0})
        assert bad_version.status_code == 422
    backend.close()


# -- stores written before assets --------------------------------------------------------


def test_an_older_sqlite_file_gets_the_asset_columns_and_reads_as_before(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    s = SqliteStore(path)
    s.add_tasks(tasks(1))
    s.enqueue(["t0"])
    (r,) = s.claim("r")
    s.add_spans([span(r, 0)])
    s.close()
    db = sqlite3.connect(path)  # undo what assets added: the file an older tracerl wrote
    for statement in (
        "ALTER TABLE spans DROP COLUMN assets", "ALTER TABLE rollouts DROP COLUMN assets",
        "ALTER TABLE rollouts DROP COLUMN seed", "DROP TABLE assets", "DROP TABLE comparisons",
        "DROP TABLE optimizations",
    ):  # fmt: skip
        db.execute(statement)
    db.commit()
    db.close()
    s = SqliteStore(path)
    assert s.spans(r.id)[0].assets == {} and s.get_rollout(r.id).assets is None
    assert s.put_asset("format", "x").version == 1
    s.close()


def test_a_postgres_database_of_schema_1_is_migrated(pg_url: str) -> None:  # noqa: F811
    from tracerl.store.postgres import PostgresStore
    from tracerl.store.postgres_schema import MIGRATIONS, migrate, schema_version

    with psycopg.connect(pg_url, autocommit=True) as conn:
        migrate(conn, MIGRATIONS[:1])
        conn.execute(
            "INSERT INTO tasks (id, input, answer, split) VALUES ('t', '{}', 'null', 'train')"
        )
        conn.execute(
            "INSERT INTO rollouts (id, task_id, status, attempt, max_attempts, created_at) "
            "VALUES ('r', 't', 'queued', 0, 3, 0)"
        )
    pg = PostgresStore(pg_url)
    try:
        assert pg.get_rollout("r").assets is None and pg.get_rollout("r").seed is None
        assert pg.put_asset("format", "x").version == 1
        with psycopg.connect(pg_url) as conn:
            assert schema_version(conn) == len(MIGRATIONS)
    finally:
        pg.close()


def test_store_migrate_copies_assets_and_their_records(pg_url: str, tmp_path: Path) -> None:  # noqa: F811
    from tracerl.store.migrate import copy_sqlite_to_postgres
    from tracerl.store.postgres import PostgresStore

    source = SqliteStore(tmp_path / "s.db")
    source.put_asset("format", "one")
    source.put_asset("format", "two", candidate=True)
    source.add_comparison(_comparison())
    source.put_optimization(Optimization(id="o1", name="format", seed=1, proposer="bootstrap"))
    source.close()
    first = copy_sqlite_to_postgres(tmp_path / "s.db", pg_url)
    again = copy_sqlite_to_postgres(tmp_path / "s.db", pg_url)
    assert (first.assets, first.comparisons, first.optimizations) == (2, 1, 1)
    assert (again.assets, again.comparisons, again.optimizations) == (0, 0, 0)
    pg = PostgresStore(pg_url)
    try:
        assert [(a.version, a.candidate) for a in pg.asset_versions("format")] == [
            (1, False), (2, True)
        ]  # fmt: skip
        assert pg.comparisons() == [_comparison()] and pg.optimizations()[0].id == "o1"
    finally:
        pg.close()
