"""The gateway's fast paths to a local store: spans written by the loop itself when nothing
waits, else by the span writer's thread in groups (one transaction for the calls that
arrive together), each call still refused or recorded on its own, durably before it is
answered, in order per attempt; and the rollout lookup read at once on the loop, through a
second connection that sees every commit."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from tracerl.gateway.writer import CHECKPOINT_EVERY, SpanWriter
from tracerl.store import LeaseLost, StoreError
from tracerl.store.sqlite import SqliteStore
from tracerl.types import Rollout, RolloutStatus, Span, Task

from .test_store_threads import _span


def _running(store: SqliteStore, n: int) -> list[Rollout]:
    store.add_tasks([Task(id=f"t{i}", input={}) for i in range(n)])
    store.enqueue([f"t{i}" for i in range(n)], max_attempts=3)
    return store.claim("runner", n, 60.0)


def _call(r: Rollout, name: str) -> list[Span]:
    """One call's span (its seq is the store's to pick)."""
    return [_span(r.id, r.attempt, 0).model_copy(update={"id": f"{r.id}-{name}"})]


def test_a_refused_group_is_undone_alone(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    live, ended = _running(store, 2)
    store.finish(ended.id, ended.attempt, RolloutStatus.failed)
    two = [*_call(live, "a"), *_call(live, "b")]
    out = store.append_groups([_call(live, "x"), _call(ended, "y"), two])
    assert out[0] == [0] and isinstance(out[1], LeaseLost) and out[2] == [1, 2]
    assert [s.id for s in store.spans(live.id)] == [f"{live.id}-{n}" for n in "xab"]
    assert store.spans(ended.id) == []
    dup = store.append_groups([_call(live, "x"), _call(live, "z")])  # id taken: Conflict
    assert isinstance(dup[0], StoreError) and dup[1] == [3]


def test_concurrent_writers_one_refused_the_others_recorded_in_order(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = SqliteStore(path)
    live, ended = _running(store, 2)
    store.finish(ended.id, ended.attempt, RolloutStatus.failed)
    writer = SpanWriter(store)

    async def calls() -> list[list[int] | BaseException]:
        writes = [writer.append(_call(live, f"c{i}")) for i in range(20)]
        writes.insert(7, writer.append(_call(ended, "late")))
        return await asyncio.gather(*writes, return_exceptions=True)

    out = asyncio.run(calls())
    writer.close()
    assert isinstance(out[7], LeaseLost)
    assert [o for i, o in enumerate(out) if i != 7] == [[i] for i in range(20)]
    # Answered only once committed: another connection (a process reading the file) sees it.
    other = SqliteStore(path)
    assert [s.seq for s in other.spans(live.id)] == list(range(20))
    assert [s.id for s in other.spans(live.id)] == [f"{live.id}-c{i}" for i in range(20)]
    assert other.spans(ended.id) == []


def test_a_failed_transaction_fails_every_caller_of_its_group(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    (live,) = _running(store, 1)
    writer = SpanWriter(store)
    store.close()  # every write now raises StoreError

    async def calls() -> list[list[int] | BaseException]:
        writes = [writer.append(_call(live, f"c{i}")) for i in range(3)]
        return await asyncio.gather(*writes, return_exceptions=True)

    assert all(isinstance(o, StoreError) for o in asyncio.run(calls()))
    writer.close()


def test_the_loop_read_sees_every_commit_and_never_waits(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    (r,) = _running(store, 1)
    assert store.rollout_now(r.id) == store.get_rollout(r.id)
    store.requeue_expired(now=time.time() + 3600)  # its lease ran out: retried
    (again,) = store.claim("runner", 1, 60.0)
    now = store.rollout_now(r.id)
    assert now is not None and now.attempt == again.attempt == r.attempt + 1
    with store._tx():  # a writer holds the connection (and the lock): the read still answers
        assert store.rollout_now(r.id) == now
    with pytest.raises(StoreError, match="no rollout"):
        store.rollout_now("nope")
    assert SqliteStore(":memory:").rollout_now(r.id) is None  # no second connection: a thread's
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.rollout_now(r.id)


def test_the_loop_append_never_waits_and_says_when_it_cannot(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = SqliteStore(path)
    live, ended = _running(store, 2)
    assert store.append_now(_call(live, "a")) == [0]
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process is writing: no wait, None at once
    started = time.perf_counter()
    assert store.append_now(_call(live, "b")) is None
    assert time.perf_counter() - started < 1.0
    other.execute("COMMIT")
    assert store.append_now(_call(live, "b")) == [1]
    store.finish(ended.id, ended.attempt, RolloutStatus.failed)
    with pytest.raises(LeaseLost):
        store.append_now(_call(ended, "late"))
    assert SqliteStore(":memory:").append_now(_call(live, "c")) is None
    assert [s.id for s in SqliteStore(path).spans(live.id)] == [f"{live.id}-{n}" for n in "ab"]


def test_writes_the_loop_cannot_make_go_to_the_thread_in_order(tmp_path: Path) -> None:
    """While another process writes, calls queue for the writer thread (grouped); once it
    is done, the loop writes inline again, and the seqs follow arrival throughout."""
    path = tmp_path / "s.db"
    store = SqliteStore(path)
    (live,) = _running(store, 1)
    writer = SpanWriter(store)
    other = sqlite3.connect(path, isolation_level=None)

    async def calls() -> list[list[int] | BaseException]:
        first = await writer.append(_call(live, "c0"))  # inline
        other.execute("BEGIN IMMEDIATE")
        queued = [asyncio.ensure_future(writer.append(_call(live, f"c{i}"))) for i in (1, 2, 3)]
        await asyncio.sleep(0.2)
        assert not any(q.done() for q in queued)  # waiting for the file, on the thread
        other.execute("COMMIT")
        rest = await asyncio.gather(*queued)
        return [first, *rest, await writer.append(_call(live, "c4"))]

    assert asyncio.run(calls()) == [[i] for i in range(5)]
    writer.close()
    assert [s.id for s in SqliteStore(path).spans(live.id)] == [f"{live.id}-c{i}" for i in range(5)]


def test_inline_writes_are_checkpointed_by_the_thread(tmp_path: Path) -> None:
    """The loop's connection never checkpoints; the thread moves its pages into the file."""
    path = tmp_path / "s.db"
    store = SqliteStore(path)
    (live,) = _running(store, 1)
    writer = SpanWriter(store)
    before = path.stat().st_size

    async def calls() -> None:
        for i in range(CHECKPOINT_EVERY):
            await writer.append(_call(live, f"c{i}"))

    asyncio.run(calls())
    writer.close()  # the thread has done the checkpoint asked for by then
    written = sum(len(s.model_dump_json()) for s in store.spans(live.id))
    assert path.stat().st_size - before > written // 2  # the spans are in the file itself
