"""The gateway's span writer: every call's spans recorded, durably and in order, at the
least cost to the event loop.

A call made while nothing else is being written is written by the loop itself, on the
store's second connection (LocalStore.append_now), which never waits: it fails at once when
another thread or process is writing, and then the call goes the other way. That way is
a thread of the writer's own, which writes the calls that arrive together in one
transaction (group commit). The loop hands it the writes of one of its turns as one item,
and the thread answers a whole group with one call_soon_threadsafe.

Why not always the thread: each hand-over wakes it, and a woken thread contends for the
GIL with the loop that woke it (on a busy machine, a context switch or two per call: more
than the write itself). Why a thread of its own rather than a job per write on the store
executor: a hop through a ThreadPoolExecutor costs the loop more still (its futures and idle
semaphore take locks that the worker may hold while it waits for the GIL). The WAL pages
that inline writes leave are checkpointed by the thread, every CHECKPOINT_EVERY of them
(a checkpoint syncs the disk: never on the loop).

What a caller is promised either way:
- durable: its future completes only once the transaction holding its spans has committed
  (nothing is acknowledged that a crash right after the reply could lose);
- ordered: writes are taken in arrival order (a write goes inline only when no earlier one
  is still on its way) and each attempt's seqs are picked inside the transaction, so an
  attempt's calls are numbered as they would be one write at a time;
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

__all__ = ["CHECKPOINT_EVERY", "MAX_GROUP", "SpanWriter"]

MAX_GROUP = 256
"""Calls written in one transaction, at most (unless one turn of the loop made more): a
bound on how long one commit holds the file."""

CHECKPOINT_EVERY = 500
"""Inline writes between two checkpoints of the WAL (about SQLite's own autocheckpoint of
1,000 pages: a span takes one or two)."""

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
        self._queue: SimpleQueue[list[_Write] | None] = SimpleQueue()
        """Batches for the thread; an empty one asks for a checkpoint, None for the end."""
        self._batch: list[_Write] = []
        """Writes made since the loop last handed a batch to the thread (`append`)."""
        self._outstanding = 0
        """Writes given to the thread and not yet answered (under _lock)."""
        self._inline = 0
        """Inline writes since the last checkpoint was asked for."""
        self._thread: threading.Thread | None = None
        """Started by the first write (a gateway that records nothing has none)."""
        self._lock = threading.Lock()

    async def append(self, spans: list[Span]) -> list[int]:
        """Record the spans at the next seqs of their attempts; their seqs, once committed.
        A caller cancelled meanwhile still has its spans written (as a store-thread job
        that had started); a parent lookup that misses them finds them in the store."""
        self._start()
        if not self._outstanding and (seqs := self._store.append_now(spans)) is not None:
            self._inline += 1
            if self._inline >= CHECKPOINT_EVERY:
                self._inline = 0
                self._queue.put([])
            return seqs
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        # Handed over once per turn of the loop, not once per call (module doc).
        if not self._batch:
            loop.call_soon(self._hand_over)
        self._batch.append(_Write(spans, done))
        with self._lock:
            self._outstanding += 1
        return await done

    def _hand_over(self) -> None:
        batch, self._batch = self._batch, []
        self._queue.put(batch)

    def close(self) -> None:
        """Write what is queued, then stop the thread (after the HTTP server has stopped)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            if self._batch:  # not handed over yet (its loop has stopped turning)
                self._hand_over()
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
            batches = [self._queue.get()]
            with contextlib.suppress(Empty):
                while sum(len(b) for b in batches if b) < MAX_GROUP:
                    batches.append(self._queue.get_nowait())
            writes = [w for b in batches if b is not None for w in b]
            if writes:
                self._write(writes)
            if [] in batches:
                with contextlib.suppress(Exception):  # a busy file: the next one will do
                    self._store.checkpoint()
            if None in batches:  # close() asked: everything before it is written
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
        with self._lock:
            self._outstanding -= len(writes)


def _answer(answers: list[tuple[_Write, Outcome]]) -> None:
    """Settle each caller's future with its outcome (on its loop), unless it stopped waiting."""
    for w, outcome in answers:
        if w.done.done():
            continue
        if isinstance(outcome, Exception):
            w.done.set_exception(outcome)
        else:
            w.done.set_result(outcome)
