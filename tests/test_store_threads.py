"""One SqliteStore shared by many threads, as in a training process: workers claim,
record spans and rewards, heartbeat and finish while readers list and count, and a second
connection on the same file (another process's) claims too. Nothing may fail, nothing may
be claimed twice, and no write may be lost."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tracerl.store import StoreError
from tracerl.store.sqlite import SqliteStore
from tracerl.types import Reward, RolloutStatus, Span, Task

ROLLOUTS = 240
SPANS_EACH = 3


def _span(rollout_id: str, attempt: int, seq: int) -> Span:
    return Span(
        id=f"{rollout_id}-{attempt}-{seq}",
        rollout_id=rollout_id,
        attempt=attempt,
        seq=seq,
        role="policy",
        policy_version=0,
        prompt_ids=list(range(50)),
        completion_ids=[seq, seq + 1],
        logprobs=[-0.5, -0.25],
        messages=[{"role": "user", "content": f"call {seq}"}],
        response={"message": {"role": "assistant", "content": "ok"}},
        finish_reason="stop",
        temperature=1.0,
        latency_s=0.0,
    )


def _threads(targets: list[Callable[[], None]]) -> list[BaseException]:
    """Run every target on its own thread; the exceptions they raised."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as e:  # collected, so the test sees every failure
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


def test_threads_sharing_one_store_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "traces.db"
    store = SqliteStore(path)
    other = SqliteStore(path)  # another process's connection to the same file
    store.add_tasks([Task(id=f"t{i}", input={"i": i}) for i in range(12)])
    store.enqueue([f"t{i % 12}" for i in range(ROLLOUTS)], group_id="g")
    claimed: list[str] = []
    done = threading.Event()

    def worker(s: SqliteStore, name: str) -> Callable[[], None]:
        def run() -> None:
            while batch := s.claim(name, n=2, lease_s=60.0):
                for r in batch:
                    claimed.append(r.id)
                    s.add_spans([_span(r.id, r.attempt, k) for k in range(SPANS_EACH - 1)])
                    s.add_span(_span(r.id, r.attempt, SPANS_EACH - 1))
                    s.heartbeat(r.id, r.attempt, 60.0)
                    s.add_reward(Reward(rollout_id=r.id, attempt=r.attempt, value=0.5))
                    s.finish(r.id, r.attempt, RolloutStatus.succeeded, "42", reward=1.0)

        return run

    def reader() -> None:
        while not done.is_set():
            assert sum(store.counts().values()) == ROLLOUTS
            for r in store.rollouts(status=RolloutStatus.succeeded, limit=5):
                assert len(store.spans(r.id)) == SPANS_EACH
            store.requeue_expired()

    workers = [worker(store, f"w{i}") for i in range(6)] + [worker(other, "far")]
    readers = [reader, reader]

    def work() -> None:
        errors = _threads(workers)
        done.set()
        if errors:
            raise errors[0]

    errors = _threads([work, *readers])
    assert not errors, errors
    assert len(claimed) == len(set(claimed)) == ROLLOUTS  # each claimed exactly once
    assert store.counts()[RolloutStatus.succeeded] == ROLLOUTS
    for r in store.rollouts():
        assert [s.seq for s in store.spans(r.id)] == list(range(SPANS_EACH))
        assert [w.value for w in store.rewards(r.id)] == [0.5, 1.0]
    other.close()
    store.close()


def test_close_is_idempotent_and_later_calls_raise_store_error() -> None:
    store = SqliteStore()
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.counts()
    with pytest.raises(StoreError, match="closed"):
        store.claim("w")
