"""The asynchronous rollout source: generation never waits for training.

A background thread (its own event loop) keeps issuing groups and running them with the
source's runner while the trainer trains. The trainer takes complete groups through a
windowed FIFO (any complete group among the oldest `window` pending ones, so a long-tail
rollout neither blocks the others nor starves), and never trains on a rollout sampled by a
policy older than current - max_staleness: such a rollout is dropped, or its task re-run in
the same group (`stale`).

A batch gives up (`NoBatch`) when curation dropped `max_topups` x tasks_per_step groups and
kept none (as sync mode does after its top-ups), or when `interrupt()` says a stop was asked
while it waited; the groups it had taken are then pending again, so nothing is lost.

A stale rollout whose task is re-run stays in the store under its group, beside its
replacement; which rollouts were replaced is appended to the `journal` (the run dir's
replaced.jsonl) before the replacement is queued. A resumed source reads it back, so every
group, pending at the checkpoint or issued after it, leaves its replaced rollouts out and
keeps its size.

Threads: the trainer thread calls `batch`; the source's thread runs the runner's event
loop and issues groups. `_lock` guards what both touch (pending groups, dirty ids).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tracerl.algorithms.curation import Curation
from tracerl.pipeline.sources import (
    Agents,
    Enqueue,
    NoBatch,
    SourceState,
    SourceStats,
    TaskOrder,
    issue_group,
    never,
    no_signal,
    plain_enqueue,
    read_finished,
)
from tracerl.store import Store
from tracerl.types import FINISHED, FinishedRollout, Group, Rollout, Task

__all__ = ["AsyncSource"]


@dataclass
class _Pending:
    """A group issued to the runners and not yet trained or dropped."""

    index: int
    id: str
    task: Task
    discarded: set[str] = field(default_factory=set)
    """Ids of its stale rollouts whose task was re-run (never trained)."""
    read: dict[str, FinishedRollout] = field(default_factory=dict)
    """Its finished rollouts read so far (each is read from the store once)."""


class AsyncSource:
    """Generation that never waits for training; see the module docstring.

    `version()` is the trainer's current policy version. Issuing is bounded so generation
    does not run far ahead of training: at most (max_staleness + 1) x tasks_per_step groups
    are pending at once (the same bound that keeps most rollouts within the staleness
    limit); `window` is how many of the oldest pending groups the trainer may pick from.
    `journal` is where replaced stale rollouts are recorded (None: in memory only).
    """

    def __init__(
        self,
        run: str,
        store: Store,
        agents: Agents,
        order: TaskOrder,
        curation: Curation,
        version: Callable[[], int],
        max_staleness: int = 2,
        window: int | None = None,
        stale: Literal["drop", "requeue"] = "requeue",
        max_attempts: int = 3,
        poll_s: float = 0.02,
        trained_roles: Collection[str] | None = None,
        max_topups: int = 3,
        journal: Path | None = None,
        enqueue: Enqueue = plain_enqueue,
    ) -> None:
        self.run, self.store, self.order, self.curation = run, store, order, curation
        self.enqueue = enqueue
        # Only trained roles' spans age: a frozen role's weights never change.
        self.trained_roles = None if trained_roles is None else frozenset(trained_roles)
        self.version, self.max_staleness, self.stale = version, max_staleness, stale
        self.limit = (max_staleness + 1) * order.per_step
        self.window = min(window or 2 * order.per_step, self.limit)
        self.max_attempts, self.poll_s, self.max_topups = max_attempts, poll_s, max_topups
        self.interrupt: Callable[[], bool] = never
        self.journal = journal
        self._replaced = _read_journal(journal)
        """Group id -> its rollouts replaced as stale, as the journal holds them."""
        self.stats = SourceStats()
        self.issued = 0
        self.pending: list[_Pending] = []
        self.consumed_below = 0
        self.consumed: set[int] = set()
        self.paused = False
        self._ages: list[int] = []
        self._lock = threading.Lock()
        # The runner says which groups just had a rollout finish, so a waiting batch re-reads
        # those from the store instead of every pending group at every poll. A full re-read
        # every `rescan_s` still catches rollouts finished elsewhere (runners in another
        # process, leases expired).
        self._dirty: set[str] = set()
        self.rescan_s = 0.25
        self.runner = agents.runner(store, on_finish=self._finished)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main_task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self.started_at = time.perf_counter()

    def _finished(self, rollout: Rollout) -> None:
        with self._lock:
            self._dirty.add(rollout.group_id or "")

    # -- issuing (the source's thread) -------------------------------------------------

    def group_id(self, index: int, task: Task) -> str:
        """Deterministic, so a resumed run finds the groups it had issued."""
        return f"{self.run}/g{index}-{task.id}"

    def _issue(self) -> None:
        """Top the pending groups up to the bound (skipped while paused for evaluation)."""
        with self._lock:
            while not self.paused and len(self.pending) < self.limit:
                task = self.order.task(self.issued)
                gid = self.group_id(self.issued, task)
                size = self.curation.group_size(task.id)
                issue_group(self.store, gid, task, size, self.max_attempts, self.enqueue)
                replaced = set(self._replaced.get(gid, ()))  # a reused store's, or a resumed run's
                self.pending.append(_Pending(self.issued, gid, task, replaced))
                self.issued += 1

    async def _issue_forever(self) -> None:
        while True:
            await asyncio.to_thread(self._issue)
            await asyncio.sleep(self.poll_s)

    async def _main(self) -> None:
        issuing = asyncio.create_task(self._issue_forever())
        try:
            await self.runner.run(until_idle=False)
        finally:
            issuing.cancel()

    def start(self) -> None:
        """Start issuing and running rollouts in a background thread."""
        if self._thread is not None:
            return
        self.started_at = time.perf_counter()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def serve() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._main_task = self._loop.create_task(self._main())
            ready.set()
            try:
                self._loop.run_until_complete(self._main_task)
            except asyncio.CancelledError:
                pass  # close() cancelled it: in-flight rollouts are left to their leases
            finally:
                _drain(self._loop)

        self._thread = threading.Thread(target=serve, name="tracerl-async-source", daemon=True)
        self._thread.start()
        ready.wait()

    def close(self) -> None:
        """Stop issuing and cancel the rollouts in flight, then wait for the thread: once
        this returns the source writes nothing more. Cancelled rollouts stay running in the
        store until their leases expire (a resumed run re-queues them at once)."""
        if self._thread is None or self._loop is None or self._main_task is None:
            return
        self._loop.call_soon_threadsafe(self._main_task.cancel)
        self._thread.join()
        self._thread = None

    def pause(self, paused: bool) -> None:
        """Stop (or resume) issuing new groups and claiming queued rollouts, e.g. while a
        held-out evaluation runs: its own pool then runs every evaluation rollout (and its
        progress bar sees each one finish) instead of sharing them with this runner."""
        self.paused = paused
        self.runner.paused = paused

    # -- taking batches (the trainer's thread) -----------------------------------------

    def _stale(self, f: FinishedRollout, current: int) -> int:
        """current version - the oldest version that sampled any of the rollout's trained
        spans (a frozen role's, or a remote role's text-only spans, do not age)."""
        roles = self.trained_roles
        versions = [
            s.policy_version
            for s in f.spans
            if s.completion_ids and (roles is None or s.role in roles)
        ]
        return current - min(versions) if versions else 0

    def _complete(self, p: _Pending, current: int) -> Group | None:
        """The group if all its rollouts are finished and fresh enough; re-runs stale ones."""
        rollouts = [r for r in self.store.rollouts(group_id=p.id) if r.id not in p.discarded]
        if any(r.status not in FINISHED for r in rollouts):
            return None
        fresh: list[tuple[FinishedRollout, int]] = []
        for r in rollouts:
            if r.id not in p.read:
                p.read[r.id] = self.stats.saw(read_finished(self.store, r))
            f = p.read[r.id]
            age = self._stale(f, current)
            if age <= self.max_staleness:
                fresh.append((f, age))
            elif self.stale == "requeue":
                self._replace(p, r.id)
                del p.read[r.id]
                self.stats.stale_requeued += 1
            else:
                self.stats.stale_dropped += 1
        if self.stale == "requeue" and len(fresh) < len(rollouts):
            return None
        self._ages += [age for _, age in fresh]
        return Group(id=p.id, task=p.task, rollouts=[f for f, _ in fresh])

    def _replace(self, p: _Pending, rollout_id: str) -> None:
        """Leave a stale rollout out of its group and re-run its task there: journaled
        first, so a crash in between can lose a replacement but never count a stale one."""
        if self.journal is not None:
            with self.journal.open("a") as f:
                f.write(json.dumps({"group": p.id, "rollout": rollout_id}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        p.discarded.add(rollout_id)
        with self._lock:
            self._replaced.setdefault(p.id, set()).add(rollout_id)
        self.enqueue(self.store, [p.task.id], p.id, self.max_attempts)

    def _window(self, scanned: float) -> tuple[list[_Pending], bool]:
        """The pending groups to look at: the whole window on a full re-read (due every
        rescan_s), else the ones with a rollout finished since the last look."""
        full = time.perf_counter() - scanned >= self.rescan_s
        with self._lock:
            window = list(self.pending[: self.window])
            dirty, self._dirty = self._dirty, set()
        return (window if full else [p for p in window if p.id in dirty]), full

    def batch(self, step: int) -> list[Group]:
        """Wait for tasks_per_step complete groups among the oldest `window` pending ones;
        NoBatch when it gives up (see the module docstring)."""
        self.start()
        started = time.perf_counter()
        self.stats, self._ages = SourceStats(), []
        out: list[Group] = []
        taken: list[_Pending] = []
        skipped, give_up = 0, self.max_topups * self.order.per_step
        scanned = 0.0  # when every group of the window was last read: never
        while len(out) < self.order.per_step:
            current = self.version()
            window, full = self._window(scanned)
            if full:
                scanned = time.perf_counter()
                if self.interrupt():  # a stop asked while waiting (a pause blocks in it)
                    self._restore(taken)
                    raise NoBatch(f"step {step + 1}: stopped while waiting for its batch")
            took = False
            for p in window:
                group = self._complete(p, current)
                if group is None:
                    continue
                self._consume(p)
                took = True
                kept, _ = self.curation.curate([group], out)
                skipped += not kept
                out += kept
                taken += [p] if kept else []
                if len(out) == self.order.per_step or skipped >= give_up:
                    break  # a window read at once must not drop past give_up either
            if skipped >= give_up:
                break  # nearly every group is solved or failed: as sync after its top-ups
            if not took:
                time.sleep(self.poll_s)
        self._close_stats(started)
        if not out:
            raise no_signal(step, skipped)
        return out

    def _close_stats(self, started: float) -> None:
        self.stats.wait_s = time.perf_counter() - started
        self.stats.pending_groups = len(self.pending)
        self.stats.utilisation = self.utilisation()
        if self._ages:
            self.stats.staleness_mean = sum(self._ages) / len(self._ages)
            self.stats.staleness_max = max(self._ages)

    def _consume(self, p: _Pending) -> None:
        with self._lock:
            self.pending.remove(p)
            self.consumed.add(p.index)
            while self.consumed_below in self.consumed:  # keep only the ragged edge
                self.consumed.discard(self.consumed_below)
                self.consumed_below += 1

    def _restore(self, taken: list[_Pending]) -> None:
        """Put the groups a given-up batch had taken back among the pending, unconsumed."""
        with self._lock:
            done = (set(range(self.consumed_below)) | self.consumed) - {p.index for p in taken}
            self.consumed_below = min(set(range(len(done) + 1)) - done)
            self.consumed = {k for k in done if k > self.consumed_below}
            self.pending = sorted(self.pending + taken, key=lambda p: p.index)

    # -- checkpoints ------------------------------------------------------------------

    def state(self) -> SourceState:
        with self._lock:
            return SourceState(
                issued=self.issued,
                consumed_below=self.consumed_below,
                consumed=sorted(self.consumed),
                discarded={p.id: sorted(p.discarded) for p in self.pending if p.discarded},
            )

    def load_state(self, state: SourceState) -> None:
        """Rebuild the pending groups: issued and not consumed, plus any issued after the
        checkpoint (found in the store), in issue order."""
        issued = state.issued
        while self.store.rollouts(group_id=self.group_id(issued, self.order.task(issued))):
            issued += 1
        consumed = set(state.consumed)
        with self._lock:
            self.issued, self.consumed_below = issued, state.consumed_below
            self.consumed = consumed
            self.pending = []
            for k in range(state.consumed_below, issued):
                if k in consumed:
                    continue
                task = self.order.task(k)
                gid = self.group_id(k, task)
                replaced = set(state.discarded.get(gid, [])) | self._replaced.get(gid, set())
                self.pending.append(_Pending(k, gid, task, replaced))

    def utilisation(self) -> float:
        """Share of runner slots busy since start (1.0 = every slot always running)."""
        wall = time.perf_counter() - self.started_at
        return self.runner.busy_s / max(wall * self.runner.cfg.concurrency, 1e-9)


def _read_journal(journal: Path | None) -> dict[str, set[str]]:
    """Group id -> its replaced rollouts, as journaled (a torn last line is skipped)."""
    out: dict[str, set[str]] = {}
    if journal is None or not journal.exists():
        return out
    for line in journal.read_text().splitlines():
        try:
            entry = json.loads(line)
            out.setdefault(str(entry["group"]), set()).add(str(entry["rollout"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return out


def _drain(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel every task left on the loop (rollouts in flight), wait for them and for the
    loop's worker threads (store calls in progress), then close it: nothing the loop
    started writes to the store afterwards."""
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_default_executor())
    loop.close()
