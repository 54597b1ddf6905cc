"""The gateway's span writer: one thread of its own records every call's spans, writing
the calls that arrive together in one transaction (group commit).

Why a thread of its own rather than a job per write on the store executor: a hop through a
ThreadPoolExecutor costs the event loop more than the write itself (its futures and idle
semaphore take locks that the worker may hold while it waits for the GIL, so the two
threads take turns several times per hop, each turn a context switch on a busy machine).
Here the loop only puts the write on a queue, and the thread answers a whole group with one
call_soon_threadsafe.

What a caller is promised is unchanged:
- durable: its future completes only once the transaction holding its spans has committed
  (nothing is acknowledged that a crash right after the reply could lose);
- ordered: writes are taken in arrival order and each attempt's seqs are picked inside the
  transaction, so an attempt's calls are numbered as they would be one write at a time;
- isolated: each call's spans go in a savepoint of their own (LocalStore.append_groups), so
  a call whose attempt has ended gets LeaseLost alone and the others are recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import defaultdict
from dataclasses import dataclass
from queue import Empty, SimpleQueue

from tracerl.store import LocalStore, StoreError
from tracerl.types import Span

__all__ = ["MAX_GROUP", "SpanWriter"]

MAX_GROUP = 256
"""Most calls written in one transaction (a bound on how long one commit holds the file)."""

Outcome = list[int] | StoreError | Exception
"""What a write came to: the seqs its spans took, or why it failed."""


@dataclass(frozen=True)
class _Write:
    """One call's spans, and where to answer it."""

    spans: list[Span]
    """The spans, in the order their seqs are taken."""
    done: asyncio.Future[list[int]]
    """The caller's future (set on its loop)."""


class SpanWriter:
    """`append` = `Store.append_spans`, grouped with the writes around it on one thread."""

    def __init__(self, store: LocalStore) -> None:
        self._store = store
        self._queue: SimpleQueue[_Write | None] = SimpleQueue()
        self._thread: threading.Thread | None = None
        """Started by the first write (a gateway that records nothing has none)."""
        self._lock = threading.Lock()

    async def append(self, spans: list[Span]) -> list[int]:
        """Record the spans at the next seqs of their attempts; their seqs, once committed.
        A caller cancelled meanwhile still has its spans written (as a store-thread job
        that had started); a parent lookup that misses them finds them in the store."""
        done = asyncio.get_running_loop().create_future()
        self._start()
        self._queue.put(_Write(spans, done))
        return await done

    def close(self) -> None:
        """Write what is queued, then stop the thread (after the HTTP server has stopped)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _start(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="tracerl-spans", daemon=True
                    )
                    self._thread.start()

    def _run(self) -> None:
        while True:
            group = [self._queue.get()]
            with contextlib.suppress(Empty):
                while len(group) < MAX_GROUP:
                    group.append(self._queue.get_nowait())
            writes = [w for w in group if w is not None]
            if writes:
                self._write(writes)
            if len(writes) < len(group):  # close() asked: everything before it is written
                return

    def _write(self, writes: list[_Write]) -> None:
        outcomes: list[Outcome]
        try:
            outcomes = list(self._store.append_groups([w.spans for w in writes]))
        except Exception as e:  # the transaction itself failed (the disk): every call did
            outcomes = [e] * len(writes)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Write, Outcome]]] = defaultdict(list)
        for w, outcome in zip(writes, outcomes, strict=True):
            by_loop[w.done.get_loop()].append((w, outcome))
        for loop, answers in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop has closed: nobody waits
                loop.call_soon_threadsafe(_answer, answers)


def _answer(answers: list[tuple[_Write, Outcome]]) -> None:
    """Settle each caller's future with its outcome (on its loop), unless it stopped waiting."""
    for w, outcome in answers:
        if w.done.done():
            continue
        if isinstance(outcome, Exception):
            w.done.set_exception(outcome)
        else:
            w.done.set_result(outcome)
