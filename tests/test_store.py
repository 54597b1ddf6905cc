"""The store's behaviour: lifecycle, leases, attempts, spans, rewards, versions, durability.

Every test taking the `store` fixture runs three times: on SqliteStore in memory, through
StoreClient against a live uvicorn server, and on PostgresStore against a throwaway server
(tests/pg.py; skipped where PostgreSQL is not installed), so every side of the Store
protocol agrees.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import numpy as np
import pytest

from tests.pg import pg_server, pg_url  # noqa: F401  (fixtures)
from tracerl.server import serving
from tracerl.store import (
    Conflict,
    InvalidTransition,
    LeaseLost,
    NotFound,
    SqliteStore,
    Store,
    connect,
)
from tracerl.store.http import StoreClient, create_store_app
from tracerl.store.packing import pack_floats, pack_ids, unpack_floats, unpack_ids
from tracerl.types import (
    FINISHED,
    VALID_TRANSITIONS,
    PolicyVersion,
    Reward,
    Rollout,
    RolloutStatus,
    Span,
    Task,
)

S = RolloutStatus


class _Current:
    """Forwards to the running test's store, so one server serves the whole module."""

    backend: SqliteStore

    def __getattr__(self, name: str) -> object:
        return getattr(self.backend, name)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[_Current, str]]:
    current = _Current()
    with serving(create_store_app(cast(Store, current))) as url:
        yield current, url


@pytest.fixture(params=["sqlite", "http", "postgres"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    if request.param == "postgres":
        from tracerl.store.postgres import PostgresStore

        pg = PostgresStore(request.getfixturevalue("pg_url"))
        yield pg
        pg.close()
        return
    backend = SqliteStore()
    if request.param == "sqlite":
        yield backend
    else:
        current, url = request.getfixturevalue("server")
        current.backend = backend
        client = StoreClient(url)
        yield client
        client.close()
    backend.close()


def tasks(n: int = 3) -> list[Task]:
    return [Task(id=f"t{i}", input={"question": f"{i}+1"}, answer=i + 1) for i in range(n)]


def span(r: Rollout, seq: int, attempt: int | None = None, n_prompt: int = 300) -> Span:
    rng = np.random.default_rng(seq)
    return Span(
        id=f"{r.id}-{attempt or r.attempt}-{seq}",
        rollout_id=r.id,
        attempt=r.attempt if attempt is None else attempt,
        seq=seq,
        role="policy",
        policy_version=2,
        prompt_ids=rng.integers(0, 50_000, n_prompt).tolist(),
        completion_ids=rng.integers(0, 50_000, 20).tolist(),
        logprobs=(-rng.random(20) * 5).tolist(),
        messages=[{"role": "user", "content": "what is 2+2?", "name": None}],
        response={"content": "4", "tool_calls": [{"id": "c1", "args": {"x": 1.5}}]},
        finish_reason="tool_calls",
        temperature=0.7,
        prefix_reused=n_prompt // 2,
    )


def running(store: Store, n: int = 1, max_attempts: int = 3, lease_s: float = 30.0):
    store.add_tasks(tasks(n))
    store.enqueue([f"t{i}" for i in range(n)], group_id="g", max_attempts=max_attempts)
    return store.claim("runner-a", n=n, lease_s=lease_s)


# -- tasks ------------------------------------------------------------------------------


def test_tasks_idempotent_and_conflict(store: Store) -> None:
    store.add_tasks(tasks(3) + [Task(id="e0", input={"q": "x"}, split="eval")])
    store.add_tasks(tasks(2))  # identical: no-op
    with pytest.raises(Conflict):
        store.add_tasks([Task(id="t0", input={"question": "changed"})])
    assert [t.id for t in store.tasks()] == ["t0", "t1", "t2", "e0"]
    assert [t.id for t in store.tasks("eval")] == ["e0"]
    assert store.get_task("t1") == tasks(3)[1]
    with pytest.raises(NotFound):
        store.get_task("nope")


def test_enqueue_unknown_task_adds_nothing(store: Store) -> None:
    store.add_tasks(tasks(1))
    with pytest.raises(NotFound):
        store.enqueue(["t0", "missing"])
    assert store.rollouts() == []


# -- lifecycle --------------------------------------------------------------------------


def test_claim_takes_oldest_and_sets_lease(store: Store) -> None:
    store.add_tasks(tasks(3))
    queued = store.enqueue(["t0", "t1", "t2", "t0"], group_id="g1", max_attempts=2)
    assert [r.status for r in queued] == [S.queued] * 4
    assert len({r.id for r in queued}) == 4
    before = time.time()
    got = store.claim("runner-a", n=3, lease_s=10)
    assert [r.id for r in got] == [r.id for r in queued[:3]]
    for r in got:
        assert (r.status, r.attempt, r.runner_id) == (S.running, 1, "runner-a")
        assert r.lease_expires_at is not None and r.lease_expires_at >= before + 10
        assert store.get_rollout(r.id) == r
    assert store.counts() == {
        "queued": 1, "running": 3, "succeeded": 0, "failed": 0, "timed_out": 0
    }  # fmt: skip
    assert [r.id for r in store.rollouts(status=S.queued)] == [queued[3].id]
    assert len(store.rollouts(task_id="t0")) == 2
    assert len(store.rollouts(group_id="g1", limit=2)) == 2
    assert store.claim("runner-b", n=5)[0].id == queued[3].id
    assert store.claim("runner-b") == []


@pytest.mark.parametrize("final", sorted(FINISHED))
def test_finish_from_running(store: Store, final: RolloutStatus) -> None:
    (r,) = running(store)
    done = store.finish(r.id, 1, final, answer="2", reward=0.5, error=None)
    assert (done.status, done.answer, done.reward, done.runner_id) == (final, "2", 0.5, None)
    assert done.finished_at is not None and done.lease_expires_at is None
    assert store.get_rollout(r.id) == done
    assert [(w.value, w.span_seq, w.attempt) for w in store.rewards(r.id)] == [(0.5, None, 1)]


def test_finish_twice_is_refused_and_counts_once(store: Store) -> None:
    (r,) = running(store)
    store.finish(r.id, 1, S.succeeded, reward=1.0)
    with pytest.raises(InvalidTransition):
        store.finish(r.id, 1, S.failed, reward=0.0)
    assert store.get_rollout(r.id).status is S.succeeded
    assert [w.value for w in store.rewards(r.id)] == [1.0]
    assert store.counts()["succeeded"] == 1 and store.counts()["failed"] == 0


def test_forbidden_finishes(store: Store) -> None:
    store.add_tasks(tasks(1))
    (q,) = store.enqueue(["t0"])
    with pytest.raises(InvalidTransition):  # queued -> succeeded skips running
        store.finish(q.id, 0, S.succeeded)
    (r,) = store.claim("w")
    for not_final in (S.running, S.queued):
        with pytest.raises(InvalidTransition):
            store.finish(r.id, 1, not_final)
    with pytest.raises(NotFound):
        store.finish("nope", 1, S.succeeded)


def test_cancel_queued_before_any_claim(store: Store) -> None:
    store.add_tasks(tasks(1))
    (q,) = store.enqueue(["t0"])
    assert store.finish(q.id, 0, S.failed, error="cancelled").status is S.failed
    assert store.claim("w") == []


def test_transition_table_enforced_for_every_pair() -> None:
    store = SqliteStore()
    (r,) = running(store)
    for start in S:
        for to in S:
            with store._tx() as db:
                db.execute("UPDATE rollouts SET status = ? WHERE id = ?", (start.value, r.id))
                current = store._get(db, r.id)
                if to in VALID_TRANSITIONS[start]:
                    assert store._transition(db, current, to).status is to
                    assert store._get(db, r.id).status is to
                else:
                    with pytest.raises(InvalidTransition):
                        store._transition(db, current, to)


# -- leases and attempts ----------------------------------------------------------------


def test_heartbeat_extends_lease(store: Store) -> None:
    (r,) = running(store, lease_s=1)
    assert r.lease_expires_at is not None
    beat = store.heartbeat(r.id, 1, lease_s=100)
    assert beat.lease_expires_at is not None and beat.lease_expires_at > r.lease_expires_at + 50
    assert store.get_rollout(r.id).lease_expires_at == beat.lease_expires_at
    with pytest.raises(LeaseLost):
        store.heartbeat(r.id, 2)
    with pytest.raises(NotFound):
        store.heartbeat("nope", 1)


def test_expired_lease_requeues_and_hides_old_attempt(store: Store) -> None:
    (r,) = running(store)
    store.add_spans([span(r, 0), span(r, 1)])
    store.add_reward(Reward(rollout_id=r.id, attempt=1, value=0.3, span_seq=0, name="step"))
    (back,) = store.requeue_expired(now=time.time() + 60)
    assert (back.status, back.attempt, back.runner_id, back.error) == (
        S.queued, 1, None, "lease expired"
    )  # fmt: skip
    (again,) = store.claim("runner-b")
    assert (again.id, again.attempt, again.runner_id, again.error) == (r.id, 2, "runner-b", None)
    assert store.spans(r.id) == [] and store.rewards(r.id) == []
    assert [s.seq for s in store.spans(r.id, attempt=1)] == [0, 1]
    assert [w.name for w in store.rewards(r.id, attempt=1)] == ["step"]
    # The dead runner wakes up: none of its calls may touch attempt 2.
    for late in (
        lambda: store.add_span(span(r, 2, attempt=1)),
        lambda: store.add_reward(Reward(rollout_id=r.id, attempt=1, value=1.0)),
        lambda: store.heartbeat(r.id, 1),
        lambda: store.finish(r.id, 1, S.succeeded, reward=1.0),
    ):
        with pytest.raises(LeaseLost):
            late()
    store.add_span(span(again, 0))
    done = store.finish(r.id, 2, S.succeeded, reward=1.0)
    assert (done.status, done.attempt) == (S.succeeded, 2)
    assert [s.attempt for s in store.spans(r.id)] == [2]


def test_late_calls_on_requeued_rollout_are_lease_lost(store: Store) -> None:
    (r,) = running(store)
    store.requeue_expired(now=time.time() + 60)  # queued again, attempt still 1
    with pytest.raises(LeaseLost):
        store.finish(r.id, 1, S.failed, error="crashed late")
    with pytest.raises(LeaseLost):
        store.add_span(span(r, 0))
    assert store.get_rollout(r.id).status is S.queued


def test_claim_requeues_expired_leases_first(store: Store) -> None:
    (r,) = running(store, lease_s=0.01)
    time.sleep(0.03)
    (again,) = store.claim("runner-b")
    assert (again.id, again.attempt) == (r.id, 2)


def test_max_attempts_exhaustion_times_out(store: Store) -> None:
    (r,) = running(store, max_attempts=2)
    store.requeue_expired(now=time.time() + 60)
    (r2,) = store.claim("runner-b")
    assert r2.attempt == 2
    (dead,) = store.requeue_expired(now=time.time() + 60)
    assert (dead.status, dead.error) == (S.timed_out, "lease expired after 2 attempts")
    assert dead.finished_at is not None
    assert store.claim("runner-c") == []
    with pytest.raises(LeaseLost):
        store.finish(r.id, 1, S.succeeded)
    with pytest.raises(InvalidTransition):
        store.finish(r.id, 2, S.succeeded)


def test_concurrent_claims_are_disjoint(store: Store) -> None:
    store.add_tasks(tasks(10))
    all_ids = {r.id for r in store.enqueue([f"t{i % 10}" for i in range(120)])}
    got: list[list[str]] = [[] for _ in range(6)]

    def claimer(k: int) -> None:
        while batch := store.claim(f"runner-{k}", n=3):
            got[k].extend(r.id for r in batch)

    threads = [threading.Thread(target=claimer, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [i for ids in got for i in ids]
    assert len(flat) == len(set(flat)) == 120 and set(flat) == all_ids
    assert store.counts()["running"] == 120


# -- spans and rewards ------------------------------------------------------------------


def test_span_round_trip(store: Store) -> None:
    (r,) = running(store)
    sent = [span(r, seq) for seq in (2, 0, 1)]
    store.add_spans(sent[:2])
    store.add_span(sent[2])
    got = store.spans(r.id)
    assert [s.seq for s in got] == [0, 1, 2]
    for s in got:
        want = next(x for x in sent if x.seq == s.seq)
        assert s.prompt_ids == want.prompt_ids and s.completion_ids == want.completion_ids
        # Log-probs are kept as float32: exact at float32, close at float64.
        np.testing.assert_array_equal(
            np.asarray(s.logprobs, np.float32), np.asarray(want.logprobs, np.float32), strict=False
        )
        assert s.model_dump(exclude={"logprobs"}) == want.model_dump(exclude={"logprobs"})
        assert list(s.messages[0]) == ["role", "content", "name"]  # key order kept


def test_span_errors(store: Store) -> None:
    (r,) = running(store)
    store.add_span(span(r, 0))
    with pytest.raises(Conflict):  # same seq again
        store.add_span(span(r, 0).model_copy(update={"id": "other"}))
    with pytest.raises(NotFound):
        store.add_span(span(r, 1).model_copy(update={"rollout_id": "nope"}))
    with pytest.raises(LeaseLost):
        store.add_span(span(r, 1, attempt=7))
    with pytest.raises(NotFound):
        store.spans("nope")
    # A batch with one bad span stores none of it.
    with pytest.raises(LeaseLost):
        store.add_spans([span(r, 1), span(r, 2, attempt=7)])
    assert [s.seq for s in store.spans(r.id)] == [0]


def test_the_store_numbers_appended_spans_per_attempt(store: Store) -> None:
    """Regression: the gateway numbered spans per process, so two gateways serving one
    attempt both chose the next seq and the second write was a Conflict (a 500)."""
    a, b = running(store, n=2)
    # The seq a span carries is ignored: each takes the next of its attempt, in list order.
    assert store.append_spans([span(a, 7), span(a, 8), span(b, 9)]) == [0, 1, 0]
    assert store.append_spans([span(a, 5)]) == [2]
    assert [s.seq for s in store.spans(a.id)] == [0, 1, 2]
    assert [s.id for s in store.spans(a.id)] == [span(a, k).id for k in (7, 8, 5)]
    assert [s.seq for s in store.spans(b.id)] == [0]
    with pytest.raises(LeaseLost):  # all or none
        store.append_spans([span(a, 6), span(a, 1, attempt=7)])
    with pytest.raises(Conflict):  # a span id is still recorded once
        store.append_spans([span(a, 7)])
    assert [s.seq for s in store.spans(a.id)] == [0, 1, 2]


def test_concurrent_appends_to_one_attempt_never_clash(store: Store) -> None:
    (r,) = running(store)
    errors: list[Exception] = []

    def writer(k: int) -> None:
        for i in range(5):
            try:
                store.append_spans([span(r, 100 * k + i, n_prompt=5)])
            except Exception as e:  # noqa: BLE001  (collected for the assertion)
                errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [s.seq for s in store.spans(r.id)] == list(range(20))


def test_rewards_of_finished_rollout_are_refused(store: Store) -> None:
    (r,) = running(store)
    store.add_reward(Reward(rollout_id=r.id, attempt=1, value=0.1, span_seq=0, name="format"))
    store.add_reward(Reward(rollout_id=r.id, attempt=1, value=0.5, role="executor"))
    store.finish(r.id, 1, S.succeeded, reward=1.0)
    with pytest.raises(LeaseLost):
        store.add_reward(Reward(rollout_id=r.id, attempt=1, value=2.0))
    got = [(w.name, w.value, w.span_seq, w.role) for w in store.rewards(r.id)]
    assert got == [("format", 0.1, 0, None), ("reward", 0.5, None, "executor")] + [
        ("reward", 1.0, None, None)
    ]


# -- versions -----------------------------------------------------------------------------


def test_policy_versions(store: Store) -> None:
    assert store.latest_version() is None
    store.publish_version(PolicyVersion(version=0, path="/ckpt/0"))
    store.publish_version(PolicyVersion(version=1, path="/ckpt/1"))
    store.publish_version(PolicyVersion(version=1, path="/ckpt/1"))  # republish: no-op
    store.publish_version(PolicyVersion(version=5, path="/ckpt/planner5", role="planner"))
    with pytest.raises(Conflict):
        store.publish_version(PolicyVersion(version=1, path="/elsewhere"))
    latest = store.latest_version()
    assert latest is not None and (latest.version, latest.path) == (1, "/ckpt/1")
    planner = store.latest_version("planner")
    assert planner is not None and planner.version == 5


def test_issued_versions_rise_and_are_never_reused(store: Store) -> None:
    """Regression: versions counted steps, so a resumed or rolled-back run served new
    weights under numbers that spans of other weights already carried."""
    assert store.issue_version(["policy"]) == 0
    assert store.issue_version(["policy"]) == 1
    store.publish_version(PolicyVersion(version=1, path="/ckpt/1"))  # its checkpoint, later
    assert store.issue_version(["planner", "executor"]) == 0  # other roles count apart
    # Several roles share one number, above every number any of them holds.
    assert store.issue_version(["policy", "planner"]) == 2
    latest = store.latest_version()
    assert latest is not None and (latest.version, latest.path) == (2, "")
    planner = store.latest_version("planner")
    assert planner is not None and planner.version == 2
    old = store.latest_version("executor")
    assert old is not None and old.version == 0


def test_concurrent_issues_never_share_a_number(store: Store) -> None:
    got: list[int] = []
    lock = threading.Lock()

    def issuer() -> None:
        for _ in range(5):
            v = store.issue_version(["policy"])
            with lock:
                got.append(v)

    threads = [threading.Thread(target=issuer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(20))


def test_version_served_before_its_checkpoint_gets_the_path_once(store: Store) -> None:
    store.publish_version(PolicyVersion(version=2, path=""))  # served, not yet saved
    store.publish_version(PolicyVersion(version=2, path="/ckpt/2"))
    store.publish_version(PolicyVersion(version=2, path=""))  # no path: keeps the stored one
    latest = store.latest_version()
    assert latest is not None and latest.path == "/ckpt/2"
    with pytest.raises(Conflict):
        store.publish_version(PolicyVersion(version=2, path="/ckpt/other"))


# -- packing and durability -------------------------------------------------------------


def test_packing_round_trip() -> None:
    ids = [0, 1, 2**31 - 1, 151_643]
    assert unpack_ids(pack_ids(ids)) == ids and len(pack_ids(ids)) == 16
    lp = [-0.1, -12.5, 0.0]
    assert unpack_floats(pack_floats(lp)) == np.asarray(lp, np.float32).tolist()
    with pytest.raises(OverflowError):
        pack_ids([2**31])


def test_file_store_reopens_with_everything(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = connect(path)
    (r,) = running(store)
    store.add_spans([span(r, 0), span(r, 1)])
    store.finish(r.id, 1, S.succeeded, answer="1", reward=1.0)
    store.publish_version(PolicyVersion(version=3, path="/ckpt/3"))
    store.close()
    again = SqliteStore(path)
    assert again.get_rollout(r.id).status is S.succeeded
    assert [s.seq for s in again.spans(r.id)] == [0, 1]
    assert again.spans(r.id)[1].prompt_ids == span(r, 1).prompt_ids
    assert [w.value for w in again.rewards(r.id)] == [1.0]
    assert again.tasks() == tasks(1)
    assert again.latest_version() is not None
    again.close()


def test_a_file_written_before_role_rewards_opens_and_gains_the_column(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)  # the rewards table as it was first shipped
    db.execute(
        "CREATE TABLE rewards (rollout_id TEXT NOT NULL, attempt INTEGER NOT NULL, "
        "value REAL NOT NULL, span_seq INTEGER, name TEXT NOT NULL, created_at REAL NOT NULL)"
    )
    db.execute("INSERT INTO rewards VALUES ('r0', 1, 0.25, NULL, 'reward', 1.0)")
    db.commit()
    db.close()
    store = SqliteStore(path)
    (r,) = running(store)
    store.add_reward(Reward(rollout_id=r.id, attempt=1, value=1.0, role="planner"))
    assert [w.role for w in store.rewards(r.id)] == ["planner"]
    assert [(w.value, w.role) for w in store.rewards("r0", 1)] == [(0.25, None)]
    store.close()


def test_committed_writes_survive_a_killed_process(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    script = f"""
import os
from tracerl.store import SqliteStore
from tracerl.types import Task
s = SqliteStore({str(path)!r})
s.add_tasks([Task(id="t0", input={{}})])
(r,) = s.enqueue(["t0"])
s.claim("w")
os._exit(0)  # no close, no checkpoint
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    store = SqliteStore(path)
    (r,) = store.rollouts()
    assert (r.status, r.attempt) == (S.running, 1)
    store.close()


def test_connect_picks_backend() -> None:
    assert isinstance(connect(), SqliteStore) and isinstance(connect(), Store)
    client = connect("http://127.0.0.1:1/store")
    assert isinstance(client, StoreClient) and isinstance(client, Store)
    client.close()
