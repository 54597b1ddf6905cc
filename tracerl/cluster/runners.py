"""Runners as Ray actors spread over the cluster's nodes, and the source's handle on them.

Each `RunnerActor` is an ordinary tracerl `Runner` in a Ray worker process: it claims
rollouts from the store's HTTP API (or straight from Postgres), runs the user's agent
against the gateway URL (the agent unchanged) and finishes them. Ray places the actors: a
STRICT_SPREAD placement group holds one bundle per node, and each bundle's actors are
scheduled into it, so every node runs `runners_per_node` of them.

`RemoteRunners` is what a rollout source holds in place of its in-process Runner (the same
`run`, `busy_s`, `cfg`): it starts the actors once, and its `run` only waits, for the store
to go idle (sync) or for ever (async). The actors keep claiming between batches, so they
also run the held-out evaluations' rollouts. A runner that dies (its process or its node)
leaves its rollouts running in the store until their leases expire; the next claim by any
live runner re-queues them. `on_finish` is not called: the async source's periodic re-read
finds rollouts finished elsewhere.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tracerl.agents import RewardFn, load_agent, load_callable
from tracerl.runner import Runner, RunnerConfig
from tracerl.store import Store
from tracerl.store.open import open_store

__all__ = ["ActorInfo", "PlacedRunner", "RemoteRunners", "RunnerSpec", "place_runners", "short"]


def short(node_id: str) -> str:
    """A node's name in runner ids and metrics: its Ray node id's first 8 hex digits."""
    return node_id[:8]


@dataclass(frozen=True)
class RunnerSpec:
    """What a runner actor needs to build its Runner (sent to it once, pickled)."""

    store_url: str
    """The store's HTTP API (the gateway's root URL) or a postgresql:// URL."""
    gateway_url: str
    """Base URL of the gateway the agents call."""
    agent: str
    """The agent spec ('file.py:function', 'module:function' or 'cmd:...'), loaded there."""
    reward: str | RewardFn | None
    """The reward function's spec, or the function itself (pickled), or None."""
    cfg: RunnerConfig
    """Concurrency, timeouts and leases of each actor."""
    model: str
    """The model name the agent is told to call."""


@dataclass(frozen=True)
class ActorInfo:
    """What a runner actor reports about itself."""

    node: str
    """The node it runs on: its Ray node id's first 8 hex digits."""
    pid: int
    """Its worker process."""
    raylet_pid: int
    """Its node's raylet (the worker's parent process)."""
    busy_s: float
    """Summed wall time of the rollouts it ran."""
    finished: int
    """Rollouts it finished."""


@ray.remote(max_restarts=0)
class RunnerActor:
    """A tracerl Runner in a Ray worker; async, so `info` answers while `run` runs."""

    def __init__(self, spec: RunnerSpec, name: str) -> None:
        # The node in the runner id: the store then tells which node ran each attempt.
        self.node = short(ray.get_runtime_context().get_node_id())
        threads = ThreadPoolExecutor(spec.cfg.concurrency, thread_name_prefix="tracerl-agent")
        reward = load_callable(spec.reward) if isinstance(spec.reward, str) else spec.reward
        store = open_store(spec.store_url)
        self.runner = Runner(
            store, spec.gateway_url, load_agent(spec.agent, threads), reward, spec.cfg,
            runner_id=f"{name}@{self.node}", model=spec.model,
        )  # fmt: skip

    async def run(self) -> None:
        """Claim and run rollouts until the actor is killed."""
        await self.runner.run(until_idle=False)

    async def pause(self, paused: bool) -> None:
        """Stop (or resume) claiming queued rollouts."""
        self.runner.paused = paused

    async def info(self) -> ActorInfo:
        """Where it runs and what it did."""
        r = self.runner
        return ActorInfo(self.node, os.getpid(), os.getppid(), r.busy_s, r.finished)


@dataclass
class PlacedRunner:
    """One runner actor and what the driver knows of it."""

    name: str
    handle: Any
    running: Any = None
    """The ref of its never-ending `run` call: ready only once the actor has died."""
    info: ActorInfo | None = None
    dead: bool = False


def place_runners(
    spec: RunnerSpec, nodes: int, per_node: int, cpus: float, prefix: str, timeout_s: float
) -> tuple[PlacementGroup, list[PlacedRunner]]:
    """A STRICT_SPREAD placement group of `nodes` bundles and `per_node` actors in each."""
    pg = placement_group([{"CPU": cpus * per_node}] * nodes, strategy="STRICT_SPREAD")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise TimeoutError(f"Ray could not place runners on {nodes} distinct nodes")
    placed = []
    for b in range(nodes):
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)
        for k in range(per_node):
            name = f"{prefix}runner-{b}-{k}"
            actor = RunnerActor.options(  # type: ignore[attr-defined]
                name=name, num_cpus=cpus, scheduling_strategy=strategy
            ).remote(spec, name)
            placed.append(PlacedRunner(name, actor))
    return pg, placed


class RemoteRunners:
    """A source's runner whose workers are Ray actors; see the module docstring."""

    def __init__(self, store: Store, actors: list[PlacedRunner], cfg: RunnerConfig) -> None:
        self.store, self.actors = store, actors
        self.cfg = cfg.model_copy(update={"concurrency": cfg.concurrency * len(actors)})
        """Every actor's slots together (the async source's utilisation divides by them)."""
        # The async source's thread and the training loop (metrics) both refresh.
        self._lock = threading.Lock()
        self._paused = False

    @property
    def paused(self) -> bool:
        """While set, no actor claims a queued rollout (an evaluation's own pool runs them)."""
        return self._paused

    @paused.setter
    def paused(self, paused: bool) -> None:
        self._paused = paused
        told = [a.handle.pause.remote(paused) for a in self.actors if not a.dead]
        if told:
            ray.wait(told, num_returns=len(told), timeout=5.0)

    def start(self) -> None:
        """Start every actor's claim loop (once) and learn where each one runs."""
        for a in self.actors:
            if a.running is None:
                a.running = a.handle.run.remote()
        self.refresh(timeout_s=60.0)

    def refresh(self, timeout_s: float = 1.0) -> None:
        """Note the actors that died, and the latest info of the live ones (a slow node's
        answer is waited for `timeout_s` at most)."""
        with self._lock:
            self._refresh(timeout_s)

    def _refresh(self, timeout_s: float) -> None:
        live = [a for a in self.actors if not a.dead and a.running is not None]
        if not live:
            return
        ended, _ = ray.wait([a.running for a in live], num_returns=len(live), timeout=0)
        for a in live:
            a.dead = a.running in ended
        asked = {a.handle.info.remote(): a for a in live if not a.dead}
        done, _ = ray.wait(list(asked), num_returns=len(asked), timeout=timeout_s)
        for ref in done:
            try:
                asked[ref].info = ray.get(ref)
            except ray.exceptions.RayActorError:
                asked[ref].dead = True

    @property
    def busy_s(self) -> float:
        """Summed busy time of every actor, as last reported (the dead ones' included)."""
        return sum(a.info.busy_s for a in self.actors if a.info)

    def per_node(self) -> dict[str, tuple[int, int]]:
        """Each node's (live runner actors, rollouts its actors finished), as last refreshed;
        a dead actor's rollouts still count."""
        live: Counter[str] = Counter()
        finished: Counter[str] = Counter()
        for a in self.actors:
            if a.info:
                live[a.info.node] += not a.dead
                finished[a.info.node] += a.info.finished
        return {node: (live[node], finished[node]) for node in finished}

    async def run(self, until_idle: bool = True, stop: asyncio.Event | None = None) -> None:
        """Wait until nothing is queued or running (until_idle) or `stop` is set; the actors
        do the work. Raises once every actor has died (nothing would ever finish)."""
        await asyncio.to_thread(self.start)
        stop = stop or asyncio.Event()
        last = time.monotonic()
        while not stop.is_set():
            if until_idle and await asyncio.to_thread(self._idle):
                return
            await asyncio.sleep(self.cfg.poll_s)
            if time.monotonic() - last > 1.0:
                last = time.monotonic()
                await asyncio.to_thread(self.refresh)
                if all(a.dead for a in self.actors):
                    raise RuntimeError("every runner actor died")

    def _idle(self) -> bool:
        counts = self.store.counts()
        return not counts.get("queued", 0) and not counts.get("running", 0)

    def close(self) -> None:
        """Kill every actor and wait until each is gone: nothing they run writes to the store
        afterwards (rollouts in flight are left to their leases)."""
        for a in self.actors:
            ray.kill(a.handle, no_restart=True)
        refs = [a.running for a in self.actors if a.running is not None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=30.0)
