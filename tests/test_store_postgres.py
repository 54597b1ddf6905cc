"""What only the PostgreSQL store has to prove: the transition table checked in its SQL, its
versioned migrations, several processes claiming from one queue, durability across
connections, and the copy of a SQLite run into it (`tracerl store migrate`).

The behaviour both back ends share is tests/test_store.py's, which runs on Postgres too.
Every test here gets its own database on a throwaway server (tests/pg.py).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.pg import pg_server, pg_url  # noqa: F401  (fixtures)
from tracerl.store import InvalidTransition, LeaseLost, SqliteStore, Store, StoreError
from tracerl.store.client import StoreClient
from tracerl.store.open import open_store
from tracerl.store.postgres import PostgresStore
from tracerl.store.postgres_schema import MIGRATIONS, migrate, schema_version
from tracerl.types import VALID_TRANSITIONS, PolicyVersion, Reward, RolloutStatus, Span, Task

S = RolloutStatus
PROCESSES = 4
QUEUED = 400


@pytest.fixture
def pg(pg_url: str) -> Iterator[PostgresStore]:  # noqa: F811
    store = PostgresStore(pg_url)
    yield store
    store.close()


def _span(rollout_id: str, attempt: int, seq: int) -> Span:
    return Span(
        id=f"{rollout_id}-{attempt}-{seq}", rollout_id=rollout_id, attempt=attempt, seq=seq,
        role="policy", policy_version=attempt, prompt_ids=list(range(seq, seq + 300)),
        completion_ids=[7, 2**31 - 1, seq], logprobs=[-0.5, -1.25, -3.0],
        messages=[{"role": "user", "content": f"call {seq}", "name": None}],
        response={"content": "ok"}, finish_reason="stop", temperature=0.7,
    )  # fmt: skip


# -- the lifecycle in SQL -----------------------------------------------------------------


def test_transition_table_enforced_for_every_pair(pg: PostgresStore) -> None:
    pg.add_tasks([Task(id="t0", input={})])
    (r,) = pg.enqueue(["t0"])
    for start in S:
        for to in S:
            with pg._tx() as cur:
                cur.execute("UPDATE rollouts SET status = %s WHERE id = %s", (start.value, r.id))
                current = pg._get(cur, r.id)
                if to in VALID_TRANSITIONS[start]:
                    assert pg._transition(cur, [(current, {})], to)[0].status is to
                    assert pg._get(cur, r.id).status is to
                else:
                    with pytest.raises(InvalidTransition):
                        pg._transition(cur, [(current, {})], to)


def test_a_transition_from_a_stale_read_is_refused(pg: PostgresStore) -> None:
    pg.add_tasks([Task(id="t0", input={})])
    (r,) = pg.enqueue(["t0"])
    pg.claim("runner-a")  # the rollout moved on since `r` was read
    with pg._tx() as cur, pytest.raises(InvalidTransition, match="concurrently"):
        pg._transition(cur, [(r, {})], S.running)
    assert pg.get_rollout(r.id).runner_id == "runner-a"


def test_a_finish_racing_a_requeue_has_one_winner(pg: PostgresStore) -> None:
    pg.add_tasks([Task(id="t0", input={})])
    pg.enqueue(["t0"] * 60, max_attempts=3)
    claimed = pg.claim("runner-a", n=60, lease_s=0.0)  # every lease expires at once
    outcome: dict[str, str] = {}

    def finisher() -> None:
        for r in claimed:
            try:
                pg.finish(r.id, 1, S.succeeded, reward=1.0)
                outcome[r.id] = "finished"
            except LeaseLost:
                outcome[r.id] = "lost"

    def requeuer() -> None:
        deadline = time.time() + 30  # in case the finisher died
        while len(outcome) < len(claimed) and time.time() < deadline:
            pg.requeue_expired()

    threads = [threading.Thread(target=f) for f in (finisher, requeuer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(outcome) == len(claimed)
    for r in claimed:  # the finish happened or the requeue did, never a mix of the two
        now, rewards = pg.get_rollout(r.id), [w.value for w in pg.rewards(r.id, 1)]
        if outcome[r.id] == "finished":
            assert (now.status, now.attempt, rewards) == (S.succeeded, 1, [1.0])
        else:
            assert (now.status, now.error, rewards) == (S.queued, "lease expired", [])


# -- schema and durability ----------------------------------------------------------------


def test_migrate_is_versioned_and_idempotent(pg_url: str) -> None:  # noqa: F811
    extra = "CREATE TABLE notes (id TEXT PRIMARY KEY)"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert schema_version(conn) == 0
        assert migrate(conn) == migrate(conn) == len(MIGRATIONS) == schema_version(conn)
        conn.execute("INSERT INTO tasks (id, input, answer, split) VALUES ('t', '{}', '1', 's')")
        assert migrate(conn, [*MIGRATIONS, extra]) == len(MIGRATIONS) + 1
        assert migrate(conn, [*MIGRATIONS, extra]) == len(MIGRATIONS) + 1  # applied once
        rows = conn.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
        assert [v for (v,) in rows] == list(range(1, len(MIGRATIONS) + 2))
        assert conn.execute("SELECT count(*) FROM tasks").fetchone() == (1,)  # data kept
    with pytest.raises(StoreError, match="upgrade tracerl"):  # written by a newer tracerl
        PostgresStore(pg_url)


def test_a_second_connection_sees_everything_exactly(pg: PostgresStore) -> None:
    pg.add_tasks([Task(id="t0", input={"q": "x"}, answer=[1, 2])])
    (r,) = pg.enqueue(["t0"], group_id="g")
    (r,) = pg.claim("w", lease_s=12.345678901)
    pg.add_spans([_span(r.id, 1, 0), _span(r.id, 1, 1)])
    pg.add_reward(Reward(rollout_id=r.id, attempt=1, value=0.1 + 0.2, span_seq=1))
    done = pg.finish(r.id, 1, S.succeeded, answer="3", reward=1 / 3)
    pg.publish_version(PolicyVersion(version=4, path="/ckpt/4", created_at=1e9 + 0.123456))
    other = PostgresStore(pg.url)
    # Double precision: times and rewards come back bit for bit (REAL would round them).
    assert other.get_rollout(r.id) == done and done.reward == 1 / 3
    assert [w.value for w in other.rewards(r.id)] == [0.1 + 0.2, 1 / 3]
    assert [s.completion_ids for s in other.spans(r.id)] == [[7, 2**31 - 1, 0], [7, 2**31 - 1, 1]]
    assert other.latest_version() == pg.latest_version()
    assert other.tasks() == pg.tasks() == [Task(id="t0", input={"q": "x"}, answer=[1, 2])]
    other.close()


def test_a_closed_store_refuses_every_call(pg: PostgresStore) -> None:
    pg.close()
    pg.close()  # idempotent
    for call in (pg.counts, pg.tasks, lambda: pg.claim("w"), pg.latest_version):
        with pytest.raises(StoreError, match="closed"):
            call()


def test_open_store_picks_the_backend(pg_url: str, tmp_path: Path) -> None:  # noqa: F811
    stores = [open_store(pg_url), open_store(tmp_path / "x.db"), open_store("http://127.0.0.1:1")]
    assert [type(s) for s in stores] == [PostgresStore, SqliteStore, StoreClient]
    assert all(isinstance(s, Store) for s in stores)
    for s in stores:
        s.close()


# -- several processes on one queue -------------------------------------------------------


def _claimer(target: str, runner: str, start: Any, out: Any) -> None:
    """Child process: claim, record a span, finish, until the queue is empty."""
    store = open_store(target)
    got: list[str] = []
    start.wait()
    while batch := store.claim(runner, n=4):
        for r in batch:
            store.add_span(_span(r.id, r.attempt, 0))
            store.finish(r.id, r.attempt, S.succeeded, reward=1.0)
            got.append(r.id)
    store.close()
    out.put((runner, got))


@pytest.mark.parametrize("backend", ["postgres", "sqlite-file"])
def test_processes_claiming_one_queue_get_each_rollout_once(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    target = request.getfixturevalue("pg_url") if backend == "postgres" else str(tmp_path / "q.db")
    store = open_store(target)
    store.add_tasks([Task(id=f"t{i}", input={}) for i in range(40)])
    queued = {r.id for r in store.enqueue([f"t{i % 40}" for i in range(QUEUED)])}
    ctx = mp.get_context("spawn")  # fresh interpreters: no inherited connections or locks
    start, out = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [
        ctx.Process(target=_claimer, args=(target, f"runner-{k}", start, out))
        for k in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    claimed = [i for ids in got.values() for i in ids]
    assert len(claimed) == len(set(claimed)) == QUEUED and set(claimed) == queued
    # Concurrency, not fairness: on a loaded machine one process may start after the queue
    # is drained, but the claims above came from several at once.
    assert sum(bool(v) for v in got.values()) >= 2, [len(v) for v in got.values()]
    assert store.counts() == {"queued": 0, "running": 0, "succeeded": QUEUED, "failed": 0,
                              "timed_out": 0}  # fmt: skip
    assert {r.attempt for r in store.rollouts()} == {1}  # no lease was lost and retaken
    assert all(len(store.spans(i)) == 1 for i in list(queued)[:20])
    store.close()


# -- tracerl store migrate ----------------------------------------------------------------


def _sqlite_run(path: Path) -> SqliteStore:
    """A store holding every kind of row: finished, retried, cancelled and queued rollouts,
    spans of two attempts, step and final rewards, two roles' versions."""
    s = SqliteStore(path)
    s.add_tasks([Task(id=f"t{i}", input={"q": i}, answer=i) for i in range(5)])
    s.add_tasks([Task(id="e0", input={"q": "held out"}, split="eval")])
    rs = s.enqueue(["t0", "t1", "t2", "t3", "t4", "t0"], group_id="g", max_attempts=2)
    s.finish(rs[4].id, 0, S.failed, error="cancelled")
    a, b = s.claim("w", n=2, lease_s=60)
    s.add_spans([_span(a.id, 1, 0), _span(a.id, 1, 1)])
    s.requeue_expired(now=time.time() + 120)  # both leases expire: attempt 1 is history
    a, b = s.claim("w", n=2, lease_s=60)
    s.add_spans([_span(a.id, 2, k) for k in range(3)])
    s.add_reward(Reward(rollout_id=a.id, attempt=2, value=0.25, span_seq=1, name="step"))
    s.finish(a.id, 2, S.succeeded, answer="0", reward=1.0)
    s.finish(b.id, 2, S.failed, reward=0.0)
    s.claim("w")  # one left running
    s.publish_version(PolicyVersion(version=3, path="/ckpt/3"))
    s.publish_version(PolicyVersion(version=1, path="/ckpt/p1", role="planner"))
    return s


def _cli(*args: str) -> None:
    import tracerl.cli  # here, not at the top: the claimer processes import this module

    tracerl.cli.main(["store", "migrate", *args])


def test_store_migrate_copies_everything_once(pg_url: str, tmp_path: Path) -> None:  # noqa: F811
    path = tmp_path / "traces.db"
    src = _sqlite_run(path)
    _cli("--from", str(path), "--to", pg_url, "--batch", "2")
    _cli("--from", str(path), "--to", pg_url)  # a re-run adds nothing
    dst = PostgresStore(pg_url)
    assert dst.counts() == src.counts()
    assert dst.tasks() == src.tasks() and dst.tasks("eval") == src.tasks("eval")
    assert dst.rollouts() == src.rollouts()  # every field, in the same order
    for r in src.rollouts():
        for attempt in range(r.attempt + 1):
            assert dst.spans(r.id, attempt) == src.spans(r.id, attempt)
            assert dst.rewards(r.id, attempt) == src.rewards(r.id, attempt)
    (done,) = src.rollouts(status=S.succeeded)
    assert [s.prompt_ids for s in dst.spans(done.id, 1)] == [
        list(range(k, k + 300)) for k in (0, 1)
    ]
    assert [s.seq for s in dst.spans(done.id)] == [0, 1, 2]
    for role in ("policy", "planner"):
        assert dst.latest_version(role) == src.latest_version(role)
    with psycopg.connect(pg_url) as conn:  # nothing twice after the re-run
        assert conn.execute("SELECT count(*) FROM spans").fetchone() == (5,)
        assert conn.execute("SELECT count(*) FROM rewards").fetchone() == (3,)
    # The copy is a working store: the running rollout's runner carries on against it.
    (live,) = dst.rollouts(status=S.running)
    assert dst.finish(live.id, live.attempt, S.succeeded, reward=1.0).status is S.succeeded
    src.close()
    dst.close()


def test_store_migrate_refuses_a_missing_file_and_a_non_postgres_target(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no store file"):
        _cli("--from", str(tmp_path / "none.db"), "--to", "postgresql://127.0.0.1:1/x")
    with pytest.raises(SystemExit, match="postgresql://"):
        _cli("--from", str(tmp_path / "none.db"), "--to", str(tmp_path / "copy.db"))
