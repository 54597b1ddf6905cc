"""Rollout sources: where the pipeline's training batches come from.

The source is the boundary between generation and training. Both kinds issue tasks in a
fixed order (TaskOrder) under group ids that are a function of the run and the task's
position, so a resumed run finds what it had issued instead of issuing it again. Each owns
the runner that runs its rollouts, and reads every finished rollout from the store once
(`read_finished`): the records it hands over carry their spans and rewards.

- SyncSource (here): each step issues tasks x group_size rollouts and waits for them.
- AsyncSource (tracerl.pipeline.async_source): generation never waits for training.

A source may give up on a batch (`NoBatch`): when curation dropped every group it took in
`max_topups` rounds' worth (with dynamic sampling: every group of equal reward, as on a
solved task set, a constant reward or a collapsed policy), or when `interrupt()` says a stop
was asked while it waited. The run then ends with that message instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from tracerl.agents import AgentFn, RewardFn
from tracerl.algorithms.curation import Curation
from tracerl.runner import Runner, RunnerConfig
from tracerl.store import Store
from tracerl.types import FinishedRollout, Group, Rollout, Task

__all__ = [
    "Agents",
    "Enqueue",
    "NoBatch",
    "RolloutRunner",
    "RolloutSource",
    "SourceState",
    "SourceStats",
    "SyncSource",
    "TaskOrder",
    "issue_group",
    "never",
    "no_signal",
    "plain_enqueue",
    "read_finished",
]


@dataclass
class SourceStats:
    """What a source did while producing one batch (logged by the pipeline)."""

    wait_s: float = 0.0
    """Time the trainer spent waiting for the batch (trainer idle time)."""
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
    utilisation: float | None = None
    """Share of runner slots busy since the source started (async only)."""
    reward_errors: int = 0
    """Rollouts read for this batch whose reward function raised (never trained on)."""
    reward_error: str | None = None
    """The latest such rollout's error: the reward function's traceback."""

    def saw(self, f: FinishedRollout) -> FinishedRollout:
        """Count a rollout read for the batch (its reward function's error, if any)."""
        if f.rollout.reward_failed:
            self.reward_errors += 1
            self.reward_error = f.rollout.error
        return f


class NoBatch(Exception):
    """A source gave up on a batch: nothing to train on after its top-ups, or a stop asked
    while it waited. Nothing of the step was trained; the message says why."""


def no_signal(step: int, dropped: int) -> NoBatch:
    """The give-up of a batch whose every group curation dropped."""
    return NoBatch(
        f"step {step + 1}: no group to train on: curation dropped all {dropped} groups taken "
        "(with dynamic sampling, every rollout of each got the same reward: a solved task "
        "set, a constant reward or a collapsed policy); the run stops"
    )


def never() -> bool:
    """The default `interrupt`: no stop is ever asked."""
    return False


class SourceState(BaseModel):
    """What a checkpoint keeps of a source to resume it exactly (sync sources keep none:
    their group ids are a function of the step)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    issued: int = 0
    """Groups issued so far (async)."""
    consumed_below: int = 0
    """Every group with an index below this was consumed (trained on or dropped)."""
    consumed: list[int] = []
    """Consumed group indices at or above consumed_below (the windowed FIFO takes groups
    a little out of order, so this stays within the window's size)."""
    discarded: dict[str, list[str]] = {}
    """Pending group id -> its stale rollouts whose task was re-run (never trained)."""


class RolloutSource(Protocol):
    """Where training batches come from; the seam between generation and training."""

    stats: SourceStats
    """Counters of the latest batch."""
    interrupt: Callable[[], bool]
    """Asked while a batch waits (it may block, e.g. while the run is paused); True gives
    the batch up with `NoBatch` (a stop was asked). The run loop sets it."""

    def batch(self, step: int) -> list[Group]:
        """Finished groups to train on at `step` (NoBatch: given up, see the module)."""
        ...

    def state(self) -> SourceState:
        """What a checkpoint must keep to resume the source exactly."""
        ...

    def load_state(self, state: SourceState) -> None:
        """Restore what state() returned."""
        ...

    def pause(self, paused: bool) -> None:
        """Stop (or resume) issuing new work, e.g. while a held-out evaluation runs."""
        ...

    def close(self) -> None:
        """Stop background work; once it returns, the source writes nothing more."""
        ...


class RolloutRunner(Protocol):
    """What a source needs of its runner: a Runner in this process, or the handle on runners
    elsewhere (tracerl.cluster.runners.RemoteRunners)."""

    cfg: RunnerConfig
    """Its settings; `concurrency` counts every slot it runs."""
    paused: bool
    """While set, no queued rollout is claimed (running ones go on)."""

    @property
    def busy_s(self) -> float:
        """Summed wall time of the rollouts run."""
        ...

    async def run(self, until_idle: bool = True, stop: asyncio.Event | None = None) -> None:
        """Run rollouts until nothing is queued or running (until_idle) or `stop` is set."""
        ...


RemoteRunnerFn = Callable[[Store, Callable[[Rollout], None] | None], RolloutRunner]
"""(store, on_finish) -> the runner of runners elsewhere."""


@dataclass(frozen=True)
class Agents:
    """What a source's runner needs: the gateway, the agent, its reward, how to run it."""

    gateway_url: str
    """Base URL of the gateway the agents call."""
    agent: AgentFn
    """The agent."""
    reward_fn: RewardFn | None
    """Reward function, when the agent does not return or post one."""
    cfg: RunnerConfig
    """Concurrency, timeouts, leases."""
    model: str = "policy"
    """The model name the agent is told to call (the top role)."""
    remote: RemoteRunnerFn | None = None
    """Runners elsewhere (a cluster's actors) to use instead of one in this process."""

    def runner(
        self, store: Store, on_finish: Callable[[Rollout], None] | None = None
    ) -> RolloutRunner:
        """A runner for this source's rollouts."""
        if self.remote is not None:
            return self.remote(store, on_finish)
        return Runner(
            store, self.gateway_url, self.agent, self.reward_fn, self.cfg,
            on_finish=on_finish, model=self.model,
        )  # fmt: skip


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


Enqueue = Callable[[Store, list[str], str, int], list[Rollout]]
"""How a source queues rollouts: (store, task ids, group id, max attempts) -> the rollouts
queued. A run with an asset curriculum gives each its assets (tracerl.assets.curriculum)."""


def plain_enqueue(
    store: Store, task_ids: list[str], group_id: str, max_attempts: int
) -> list[Rollout]:
    """Queue the rollouts as they are (the gateway's config decides their assets)."""
    return store.enqueue(task_ids, group_id, max_attempts)


def issue_group(
    store: Store, gid: str, task: Task, size: int, max_attempts: int,
    enqueue: Enqueue = plain_enqueue,
) -> None:  # fmt: skip
    """Queue `size` rollouts of `task` under `gid`, unless a resumed run already did."""
    store.add_tasks([task])
    if not store.rollouts(group_id=gid):
        enqueue(store, [task.id] * size, gid, max_attempts)


def read_finished(store: Store, rollout: Rollout) -> FinishedRollout:
    """The one read of a finished rollout: its last attempt's spans and rewards (none for a
    rollout without an outcome, which is never trained on)."""
    if not rollout.has_outcome:
        return FinishedRollout(rollout=rollout)
    spans = store.spans(rollout.id, rollout.attempt)
    rewards = store.rewards(rollout.id, rollout.attempt)
    return FinishedRollout(rollout=rollout, spans=spans, rewards=rewards)


class SyncSource:
    """Issues a step's rollouts and waits for all of them (reusing any already issued).

    Groups that curation drops (dynamic sampling) are replaced by fresh tasks from a
    separate top-up stream, in up to `max_topups` rounds; when none is kept, NoBatch.
    """

    def __init__(
        self,
        run: str,
        store: Store,
        agents: Agents,
        order: TaskOrder,
        curation: Curation,
        max_attempts: int = 3,
        max_topups: int = 3,
        enqueue: Enqueue = plain_enqueue,
    ) -> None:
        self.run, self.store, self.order, self.enqueue = run, store, order, enqueue
        self.runner = agents.runner(store)
        self.curation, self.max_attempts, self.max_topups = curation, max_attempts, max_topups
        self.stats = SourceStats()
        self.interrupt: Callable[[], bool] = never

    def group_id(self, step: int, index: int, task: Task) -> str:
        """Deterministic, so a resumed run finds the groups it had issued."""
        return f"{self.run}/step{step}/{index}-{task.id}"

    def _run(self, ids: list[tuple[str, Task]]) -> list[Group]:
        for gid, task in ids:
            size = self.curation.group_size(task.id)
            issue_group(self.store, gid, task, size, self.max_attempts, self.enqueue)
        asyncio.run(self.runner.run(until_idle=True))
        return [self._read(gid, task) for gid, task in ids]

    def _read(self, gid: str, task: Task) -> Group:
        rollouts = [
            self.stats.saw(read_finished(self.store, r)) for r in self.store.rollouts(group_id=gid)
        ]
        return Group(id=gid, task=task, rollouts=rollouts)

    def batch(self, step: int) -> list[Group]:
        started = time.perf_counter()
        self.stats = SourceStats()
        tasks = self.order.at(step)
        groups = self._run([(self.group_id(step, i, t), t) for i, t in enumerate(tasks)])
        kept, dropped = self.curation.curate(groups)
        kept, more = self._top_up(step, kept)
        self.stats.wait_s = time.perf_counter() - started
        if not kept:
            raise no_signal(step, len(dropped) + more)
        return kept

    def _top_up(self, step: int, kept: list[Group]) -> tuple[list[Group], int]:
        """Replace dropped groups with fresh tasks (deterministic ids: resumable); returns
        the kept groups and how many top-up groups were dropped."""
        # The top-up stream reads the task order from the far end, so it does not
        # repeat the tasks of the steps to come.
        total = len(self.order.tasks) * 1000
        dropped = 0
        for rnd in range(self.max_topups):
            missing = self.order.per_step - len(kept)
            if missing <= 0:
                break
            if self.interrupt():
                raise NoBatch(f"step {step + 1}: stopped while topping up its batch")
            base = total - (step * self.max_topups + rnd + 1) * self.order.per_step
            fresh = [self.order.task(base + i) for i in range(missing)]
            ids = [(f"{self.run}/step{step}/top{rnd}-{i}-{t.id}", t) for i, t in enumerate(fresh)]
            more, out = self.curation.curate(self._run(ids), kept)
            kept, dropped = kept + more, dropped + len(out)
        return kept[: self.order.per_step], dropped

    def state(self) -> SourceState:
        return SourceState()

    def load_state(self, state: SourceState) -> None:
        pass

    def pause(self, paused: bool) -> None:
        pass  # it issues only inside batch()

    def close(self) -> None:
        pass
