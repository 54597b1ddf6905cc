"""Rollout sources: where the pipeline's training batches come from.

The source is the boundary between generation and training. Both kinds issue tasks in a
fixed order (TaskOrder) under group ids that are a function of the run and the task's
position, so a resumed run finds what it had issued instead of issuing it again.

- SyncSource: each step issues tasks x group_size rollouts and waits for all of them.
- AsyncSource: runners never wait for the trainer. A background thread keeps issuing
  groups and running them while the trainer trains; the trainer takes complete groups
  through a windowed FIFO (any complete group among the oldest `window` pending ones, so
  a long-tail rollout neither blocks the others nor starves), and never trains on a
  rollout sampled by a policy older than current - max_staleness: such a rollout is
  dropped, or its task re-run in the same group (`stale`).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Literal, Protocol

from tracerl.runner import Runner
from tracerl.store import Store
from tracerl.types import FINISHED, Rollout, RolloutStatus, Task

__all__ = [
    "AsyncSource",
    "Curate",
    "Group",
    "GroupSize",
    "RolloutSource",
    "SourceStats",
    "SyncSource",
    "TaskOrder",
    "is_trainable",
]


@dataclass
class Group:
    """The finished rollouts of one task that share a baseline."""

    id: str
    task: Task
    rollouts: list[Rollout]


@dataclass
class SourceStats:
    """What a source did while producing one batch (logged by the pipeline)."""

    wait_s: float = 0.0
    """Time the trainer spent waiting for the batch (trainer idle time)."""
    dropped_zero_variance: int = 0
    """Complete groups skipped because every rollout got the same reward."""
    stale_dropped: int = 0
    """Rollouts not trained on because their policy was older than current - k."""
    stale_requeued: int = 0
    """Stale rollouts whose task was run again in the same group."""
    staleness_mean: float = 0.0
    """Mean of (current version - oldest span version) over the batch's rollouts."""
    staleness_max: int = 0
    """Largest such staleness in the batch."""
    pending_groups: int = 0
    """Groups issued and not yet trained or dropped, when the batch was taken."""


class RolloutSource(Protocol):
    """Where training batches come from; the seam between generation and training."""

    stats: SourceStats
    """Counters of the latest batch."""

    def batch(self, step: int) -> list[Group]:
        """Finished groups to train on at `step`."""
        ...

    def state(self) -> dict[str, object]:
        """What a checkpoint must keep to resume the source exactly."""
        ...

    def load_state(self, state: dict[str, object]) -> None:
        """Restore what state() returned."""
        ...

    def close(self) -> None:
        """Stop any background work."""
        ...


class TaskOrder:
    """Train tasks in a seeded order that reshuffles each epoch; position = step index."""

    def __init__(self, tasks: list[Task], per_step: int, seed: int) -> None:
        self.tasks, self.per_step, self.seed = tasks, per_step, seed

    def task(self, k: int) -> Task:
        """The k-th task of the stream (a pure function of k, so resuming needs no cursor)."""
        epoch, pos = divmod(k, len(self.tasks))
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 100_003 + epoch).shuffle(order)
        return self.tasks[order[pos]]

    def at(self, step: int) -> list[Task]:
        """The tasks of `step`."""
        return [self.task(k) for k in range(step * self.per_step, (step + 1) * self.per_step)]


Curate = Callable[[list[Group]], tuple[list[Group], list[Group]]]
"""Complete groups -> (kept, dropped): curation (tracerl.curation.Curator.curate) may fill
a group from a replay buffer or drop one without signal; the source tops up the dropped."""
GroupSize = Callable[[Task], int]
"""Rollouts to issue for a task (adaptive group size)."""


def _sizer(group_size: int | GroupSize) -> GroupSize:
    """A fixed group size as a function of the task, like an adaptive one."""
    return group_size if callable(group_size) else (lambda task: group_size)


def issue_group(store: Store, gid: str, task: Task, size: int, max_attempts: int) -> None:
    """Queue `size` rollouts of `task` under `gid`, unless a resumed run already did."""
    store.add_tasks([task])
    if not store.rollouts(group_id=gid):
        store.enqueue([task.id] * size, gid, max_attempts)


class SyncSource:
    """Issues a step's rollouts and waits for all of them (reusing any already issued).

    With a `curate` hook, groups it drops (dynamic sampling) are replaced by fresh tasks
    from a separate top-up stream, in up to `max_topups` rounds.
    """

    def __init__(
        self,
        run: str,
        store: Store,
        runner: Runner,
        order: TaskOrder,
        group_size: int | GroupSize,
        max_attempts: int = 3,
        curate: Curate | None = None,
        max_topups: int = 3,
    ) -> None:
        self.run, self.store, self.runner = run, store, runner
        self.order, self.max_attempts = order, max_attempts
        self.size, self.curate, self.max_topups = _sizer(group_size), curate, max_topups
        self.stats = SourceStats()

    def group_id(self, step: int, index: int, task: Task) -> str:
        """Deterministic, so a resumed run finds the groups it had issued."""
        return f"{self.run}/step{step}/{index}-{task.id}"

    def _run(self, ids: list[tuple[str, Task]]) -> list[Group]:
        for gid, task in ids:
            issue_group(self.store, gid, task, self.size(task), self.max_attempts)
        asyncio.run(self.runner.run(until_idle=True))
        return [Group(gid, task, self.store.rollouts(group_id=gid)) for gid, task in ids]

    def batch(self, step: int) -> list[Group]:
        started = time.perf_counter()
        self.stats = SourceStats()
        tasks = self.order.at(step)
        groups = self._run([(self.group_id(step, i, t), t) for i, t in enumerate(tasks)])
        if self.curate is not None:
            groups = self._top_up(step, groups)
        self.stats.wait_s = time.perf_counter() - started
        return groups

    def _top_up(self, step: int, groups: list[Group]) -> list[Group]:
        """Replace dropped groups with fresh tasks (deterministic ids: resumable)."""
        assert self.curate is not None
        kept, dropped = self.curate(groups)
        self.stats.dropped_zero_variance = len(dropped)
        # The top-up stream reads the task order from the far end, so it does not
        # repeat the tasks of the steps to come.
        total = len(self.order.tasks) * 1000
        for rnd in range(self.max_topups):
            missing = self.order.per_step - len(kept)
            if missing <= 0:
                break
            base = total - (step * self.max_topups + rnd + 1) * self.order.per_step
            fresh = [self.order.task(base + i) for i in range(missing)]
            ids = [(f"{self.run}/step{step}/top{rnd}-{i}-{t.id}", t) for i, t in enumerate(fresh)]
            more, dropped = self.curate(self._run(ids))
            kept += more
            self.stats.dropped_zero_variance += len(dropped)
        return kept[: self.order.per_step]

    def state(self) -> dict[str, object]:
        return {}

    def load_state(self, state: dict[str, object]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class _Pending:
    """A group issued to the runners and not yet trained or dropped."""

    index: int
    id: str
    task: Task
    discarded: set[str] = field(default_factory=set)
    """Ids of its stale rollouts whose task was re-run (never trained)."""


class AsyncSource:
    """Generation that never waits for training; see the module docstring.

    `version()` is the trainer's current policy version. Issuing is bounded so generation
    does not run far ahead of training: at most (max_staleness + 1) x tasks_per_step groups
    are pending at once (the same bound that keeps most rollouts within the staleness
    limit); `window` is how many of the oldest pending groups the trainer may pick from.
    """

    def __init__(
        self,
        run: str,
        store: Store,
        runner: Runner,
        order: TaskOrder,
        group_size: int | GroupSize,
        version: Callable[[], int],
        max_staleness: int = 2,
        window: int | None = None,
        stale: Literal["drop", "requeue"] = "requeue",
        max_attempts: int = 3,
        curate: Curate | None = None,
        poll_s: float = 0.02,
        trained_roles: Collection[str] | None = None,
    ) -> None:
        self.run, self.store, self.runner, self.order = run, store, runner, order
        # Only trained roles' spans age: a frozen role's weights never change.
        self.trained_roles = None if trained_roles is None else frozenset(trained_roles)
        self.size = _sizer(group_size)
        self.version, self.max_staleness, self.stale = version, max_staleness, stale
        per_step = order.per_step
        self.limit = (max_staleness + 1) * per_step
        self.window = min(window or 2 * per_step, self.limit)
        self.max_attempts, self.curate, self.poll_s = max_attempts, curate, poll_s
        self.stats = SourceStats()
        self.issued = 0
        self.pending: list[_Pending] = []
        self.consumed: list[int] = []
        self._ages: list[int] = []
        self.paused = False
        self._lock = threading.Lock()
        # The runner says which groups just had a rollout finish, so a waiting batch re-reads
        # those from the store instead of every pending group at every poll. A full re-read
        # every `rescan_s` still catches rollouts finished elsewhere (runners in another
        # process, leases expired).
        self._dirty: set[str] = set()
        self.rescan_s = 0.25
        notify = runner.on_finish

        def finished(rollout: Rollout) -> None:
            with self._lock:
                self._dirty.add(rollout.group_id or "")
            notify(rollout)

        runner.on_finish = finished
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.started_at = time.perf_counter()

    # -- issuing (background thread) -------------------------------------------------

    def group_id(self, index: int, task: Task) -> str:
        """Deterministic, so a resumed run finds the groups it had issued."""
        return f"{self.run}/g{index}-{task.id}"

    def _issue(self) -> None:
        """Top the pending groups up to the bound (skipped while paused for evaluation)."""
        with self._lock:
            while not self.paused and len(self.pending) < self.limit:
                task = self.order.task(self.issued)
                gid = self.group_id(self.issued, task)
                issue_group(self.store, gid, task, self.size(task), self.max_attempts)
                self.pending.append(_Pending(self.issued, gid, task))
                self.issued += 1

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        work = asyncio.create_task(self.runner.run(until_idle=False, stop=self._stop))
        while not self._stop.is_set():
            await asyncio.to_thread(self._issue)
            await asyncio.sleep(self.poll_s)
        await work

    def start(self) -> None:
        """Start issuing and running rollouts in a background thread."""
        if self._thread is not None:
            return
        self.started_at = time.perf_counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._main(),), daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop the runners (in-flight rollouts are abandoned to their leases)."""
        if self._thread is None or self._loop is None:
            return
        loop, stop = self._loop, self._stop
        if stop is not None:
            loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout=30)
        self._thread = None

    def pause(self, paused: bool) -> None:
        """Stop (or resume) issuing new groups, e.g. while a held-out evaluation runs."""
        self.paused = paused

    # -- taking batches (trainer thread) ---------------------------------------------

    def _stale(self, rollout: Rollout, current: int) -> int:
        """current version - the oldest version that sampled any of the rollout's trained
        spans (a frozen role's, or a remote role's text-only spans, do not age)."""
        roles = self.trained_roles
        versions = [
            s.policy_version
            for s in self.store.spans(rollout.id, rollout.attempt)
            if s.completion_ids and (roles is None or s.role in roles)
        ]
        return current - min(versions) if versions else 0

    def _complete(self, p: _Pending, current: int) -> Group | None:
        """The group if all its rollouts are finished and fresh enough; re-runs stale ones."""
        rollouts = [r for r in self.store.rollouts(group_id=p.id) if r.id not in p.discarded]
        if any(r.status not in FINISHED for r in rollouts):
            return None
        fresh = []
        for r in rollouts:
            age = self._stale(r, current)
            if age <= self.max_staleness:
                fresh.append((r, age))
            elif self.stale == "requeue":
                p.discarded.add(r.id)
                self.store.enqueue([p.task.id], p.id, self.max_attempts)
                self.stats.stale_requeued += 1
            else:
                self.stats.stale_dropped += 1
        if self.stale == "requeue" and len(fresh) < len(rollouts):
            return None
        self._ages += [age for _, age in fresh]
        return Group(p.id, p.task, [r for r, _ in fresh])

    def batch(self, step: int) -> list[Group]:
        """Wait for tasks_per_step complete groups among the oldest `window` pending ones."""
        self.start()
        started = time.perf_counter()
        self.stats, self._ages = SourceStats(), []
        out: list[Group] = []
        skipped = 0
        scanned = 0.0  # when every group of the window was last read: never
        while len(out) < self.order.per_step:
            current = self.version()
            full = time.perf_counter() - scanned >= self.rescan_s
            with self._lock:
                window = list(self.pending[: self.window])
                dirty, self._dirty = self._dirty, set()
            if full:
                scanned = time.perf_counter()
            else:
                window = [p for p in window if p.id in dirty]
            took = False
            for p in window:
                group = self._complete(p, current)
                if group is None:
                    continue
                self._consume(p)
                took = True
                kept = self.curate([group])[0] if self.curate is not None else [group]
                if not kept:
                    self.stats.dropped_zero_variance += 1
                    skipped += 1
                    continue
                out += kept
                if len(out) == self.order.per_step:
                    break
            if skipped >= 3 * self.order.per_step and out:
                break  # nearly every group is solved or failed: train on what there is
            if not took:
                time.sleep(self.poll_s)
        self.stats.wait_s = time.perf_counter() - started
        self.stats.pending_groups = len(self.pending)
        if self._ages:
            self.stats.staleness_mean = sum(self._ages) / len(self._ages)
            self.stats.staleness_max = max(self._ages)
        return out

    def _consume(self, p: _Pending) -> None:
        with self._lock:
            self.pending.remove(p)
            self.consumed.append(p.index)

    # -- checkpoints ------------------------------------------------------------------

    def state(self) -> dict[str, object]:
        with self._lock:
            return {
                "issued": self.issued,
                "consumed": list(self.consumed),
                "discarded": {p.id: sorted(p.discarded) for p in self.pending if p.discarded},
            }

    def load_state(self, state: dict[str, object]) -> None:
        """Rebuild the pending groups: issued and not consumed, plus any issued after the
        checkpoint (found in the store), in issue order."""
        issued = int(state.get("issued", 0))  # type: ignore[call-overload]
        consumed = {int(i) for i in state.get("consumed", [])}  # type: ignore[attr-defined]
        discarded: dict[str, list[str]] = state.get("discarded", {})  # type: ignore[assignment]
        while self.store.rollouts(group_id=self.group_id(issued, self.order.task(issued))):
            issued += 1
        with self._lock:
            self.issued, self.consumed = issued, sorted(consumed)
            self.pending = []
            for k in range(issued):
                if k in consumed:
                    continue
                task = self.order.task(k)
                gid = self.group_id(k, task)
                self.pending.append(_Pending(k, gid, task, set(discarded.get(gid, []))))

    def utilisation(self) -> float:
        """Share of runner slots busy since start (1.0 = every slot always running)."""
        wall = time.perf_counter() - self.started_at
        return self.runner.busy_s / max(wall * self.runner.cfg.concurrency, 1e-9)


def is_trainable(rollout: Rollout) -> bool:
    """Rollouts with an outcome to learn from (timed-out or lost ones have none)."""
    return rollout.status in (RolloutStatus.succeeded, RolloutStatus.failed)
