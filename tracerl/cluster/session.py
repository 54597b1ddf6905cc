"""A run's hold on a Ray cluster: join (or start) Ray, place what the run needs, tear it down.

`Cluster` is built by the training run (tracerl.pipeline.run) when `cluster.address` is
set, before its serving stack. It places the runners (tracerl.cluster.runners), the servers
of server engines (tracerl.cluster.engines: `engine_servers` is the stack's Placement) and
the trainer ranks (tracerl.cluster.ranks), and reports per node for the metrics. Teardown
is by handle, in two parts: `release` removes the runners and trainer ranks (before the
serving stack closes: runners write to its store); the stack's engines then stop their
own servers' actors; `close` removes whatever is left (engine servers included), then
leaves Ray, or stops it when it started Ray itself (address "local": `ray.shutdown` stops
the processes this driver started, nothing else). It never runs `ray stop`, which kills by
name machine-wide.

The engines themselves (routing, weight sync, restarts) stay in the driver beside the
gateway and the store; an in-process engine (`engine.kind = "hf"`) serves from there too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group

from tracerl.agents import RewardFn
from tracerl.cluster.config import ClusterConfig
from tracerl.cluster.engines import RayLauncher
from tracerl.cluster.ranks import TrainerRanks
from tracerl.cluster.runners import RemoteRunners, RunnerSpec, place_runners
from tracerl.pipeline.sources import Agents, RolloutRunner
from tracerl.stack import LocalStack
from tracerl.store import Store
from tracerl.store.open import is_postgres_url
from tracerl.trainer.config import TrainerConfig
from tracerl.trainer.lead import Leader
from tracerl.trainer.trainer import Trainer
from tracerl.types import Rollout

__all__ = ["Cluster"]


class Cluster:
    """Ray for one run; see the module docstring."""

    def __init__(self, cfg: ClusterConfig, run: str) -> None:
        self.cfg, self.run = cfg, run
        self.connected = not ray.is_initialized()  # an existing connection is the caller's
        if self.connected:
            ray.init(**_init_args(cfg))
        self.ranks = TrainerRanks(cfg)
        self.runners: RemoteRunners | None = None
        self.engines: list[RayLauncher] = []
        self._pg: Any = None
        self._released = False

    def engine_servers(self, replicas: int) -> RayLauncher:
        """Where a server engine's `replicas` servers start: spread over the nodes (a
        tracerl.engines.launch.Placement)."""
        launcher = RayLauncher(replicas, self.cfg, f"{self.run}/engine{len(self.engines)}/")
        self.engines.append(launcher)
        return launcher

    def agents(
        self,
        agents: Agents,
        agent: str,
        reward: str | RewardFn | None,
        store: str,
        stack: LocalStack,
    ) -> Agents:
        """`agents` whose runner is the cluster's runner actors (placed here, once). Each actor
        loads the agent from its spec (`agent`); it reaches the store through the gateway's
        store API, or straight at a postgresql:// `store`."""
        if not agent:
            raise ValueError("a cluster run loads the agent on every node: give `agent = ...`")
        store_url = store if is_postgres_url(store) else stack.url
        spec = RunnerSpec(store_url, agents.gateway_url, agent, reward, agents.cfg, agents.model)
        nodes = self.cfg.nodes or len([n for n in ray.nodes() if n["Alive"]])
        prefix = f"{self.run}/"
        self._pg, actors = place_runners(
            spec, nodes, self.cfg.runners_per_node, self.cfg.runner_cpus, prefix,
            self.cfg.place_timeout_s,
        )  # fmt: skip
        self.runners = RemoteRunners(stack.store, actors, spec.cfg)
        return replace(agents, remote=self._remote)

    def _remote(self, store: Store, on_finish: Callable[[Rollout], None] | None) -> RolloutRunner:
        """The source's runner: the actors placed by `agents` (its store is the run's)."""
        assert self.runners is not None
        return self.runners

    def trainer(self, model_dir: str | Path, cfg: TrainerConfig, device: str) -> Trainer | Leader:
        """A plain Trainer for one rank, else rank 0's Leader over the ranks' actors."""
        if self.cfg.trainer_ranks == 1:
            return Trainer(model_dir, cfg, device)
        return self.ranks.lead(model_dir, cfg, device)

    def values(self) -> dict[str, float]:
        """Metrics of the step, per node (named by its node id's first 8 hex digits):
        `cluster/runners/<node>` live runner actors, `cluster/rollouts/<node>` rollouts they
        finished so far, `cluster/nodes` the nodes with a live runner; and
        `cluster/engines/<node>` engine servers running there (server engines only)."""
        out: dict[str, float] = {}
        if self.runners is not None:
            self.runners.refresh()
            for node, (live, finished) in sorted(self.runners.per_node().items()):
                out[f"cluster/runners/{node}"] = live
                out[f"cluster/rollouts/{node}"] = finished
            out["cluster/nodes"] = sum(1 for k, v in out.items() if "/runners/" in k and v)
        servers: Counter[str] = Counter()
        for launcher in self.engines:
            servers.update(launcher.per_node())
        out |= {f"cluster/engines/{node}": n for node, n in sorted(servers.items())}
        return out

    def release(self) -> None:
        """Remove the runners and the trainer ranks; safe to call twice."""
        if self._released:
            return
        self._released = True
        if self.runners is not None:
            self.runners.close()
            self.runners = None
        self.ranks.close()
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

    def close(self) -> None:
        """Remove what the run placed and is still there, then leave (or stop) Ray; safe to
        call twice."""
        self.release()
        for launcher in self.engines:
            launcher.close()
        if self.connected:
            ray.shutdown()
            self.connected = False


def _init_args(cfg: ClusterConfig) -> dict[str, Any]:
    """ray.init's arguments: a Ray of our own for "local", else the named cluster."""
    args: dict[str, Any] = {"namespace": cfg.namespace, "logging_level": "warning"}
    if cfg.address != "local":
        return args | {"address": cfg.address}
    return args | {
        "num_cpus": cfg.num_cpus,
        "object_store_memory": cfg.object_store_memory,
        "include_dashboard": False,
    }
