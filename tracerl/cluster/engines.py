"""Engine servers on a cluster's nodes: one Ray actor per replica starts and holds its server.

With `cluster.address` set and a server engine (`engine.kind` "hf_server" or "vllm"), the
engine in the driver (tracerl.engines.launch.LaunchedEngine, beside the gateway) still
routes, syncs weights and restarts replicas exactly as on one machine; only where each
server starts changes. `RayLauncher` reserves one placement-group bundle per replica
(strategy SPREAD: distinct nodes while there are enough) and starts each replica's server
from an `EngineActor` in its bundle, with the launch code of one machine: its own process
group, a free port, its log on that node. The actor binds it to its node's address: on a
real cluster the node's IP (the gateway's machine must reach it, on a private network), on
a one-machine cluster (every node at 127.0.0.1, as in the tests) loopback, so nothing
listens beyond it. The driver waits for /health itself, so a server it cannot reach fails
at start.

A server that exits, or whose actor or node dies, is noticed by the engine's watch thread;
its recovery stops the old actor and starts a new one in the same bundle (Ray moves a dead
node's bundle to a live node), then loads the current weights into it.

Weights reach the servers as a path: the engine writes `engine.weights_dir/v<version>/` and
each server reads it. On one machine (and the simulated cluster, whose nodes share it) any
directory works; on a cluster of several machines `engine.weights_dir` must be a shared
filesystem mounted at the same path on every node (NFS, a cluster filesystem), or the
servers read nothing. The model directory, tracerl's source and the server's Python must be
at the same paths on every node too, as for the runners' agent.

Teardown is by handle: `stop` asks the actor to stop its server's process group, then
kills the actor; `close` removes the placement group. A server's process also gets SIGTERM
when its actor's process dies (however it dies), so no server outlives its actor.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tracerl.cluster.config import ClusterConfig
from tracerl.cluster.runners import short
from tracerl.engines.launch import ServerCommand, ServerProcess
from tracerl.engines.supervise import Server, wait_healthy

__all__ = ["EngineActor", "EngineInfo", "RayLauncher", "RemoteServer"]

_ASK_S = 5.0
"""Longest wait for an engine actor's answer about its server (the watch thread asks often)."""
_STOP_S = 30.0
"""Longest wait for an actor to stop its server before it is killed anyway."""


@dataclass(frozen=True)
class EngineInfo:
    """Where an engine actor started its server."""

    url: str
    """The server's base URL: the node's address and the port it listens on."""
    node: str
    """The node: its Ray node id's first 8 hex digits."""
    log_path: str
    """The server's log, on that node."""
    pid: int
    """The server's main process (on that node)."""
    actor_pid: int
    """The actor's worker process, the server's parent."""


def bind_address() -> str:
    """The address a server on this node listens on: the node's IP as Ray knows it, or
    127.0.0.1 when that is loopback (a one-machine cluster: nothing listens beyond it)."""
    ip = ray.util.get_node_ip_address()
    return "127.0.0.1" if ipaddress.ip_address(ip).is_loopback else ip


@ray.remote(max_restarts=0)
class EngineActor:
    """Holds one engine server on its node. Every call is short (the driver polls /health),
    so this sync actor runs them all on its main thread, the server's parent: the server's
    death signal is tied to the thread that started it."""

    def __init__(self) -> None:
        self.server: ServerProcess | None = None

    def start(self, command: ServerCommand) -> EngineInfo:
        """Start the server on a free port of this node's address; where it listens."""
        server = self.server = command.start(bind_address(), die_with_parent=True)
        node = short(ray.get_runtime_context().get_node_id())
        return EngineInfo(server.url, node, str(server.log_path), server.process.pid, os.getpid())

    def exited(self) -> int | None:
        """The server's exit code once it ended, else None."""
        assert self.server is not None
        return self.server.exited()

    def log_tail(self, lines: int) -> str:
        """The last lines of the server's log."""
        return self.server.log_tail(lines) if self.server else ""

    def stop(self) -> None:
        """Stop the server's whole process group."""
        if self.server is not None:
            self.server.stop()


class RemoteServer:
    """A Server (tracerl.engines.supervise) whose process an EngineActor holds on some node."""

    def __init__(self, handle: Any, info: EngineInfo) -> None:
        self.handle, self.info = handle, info
        self.url = info.url
        self.log_path = Path(info.log_path)
        self.stopped = False

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until it answers /health, asked from here (so the driver surely reaches it)."""
        wait_healthy(self, timeout_s)

    def exited(self) -> int | None:
        """Its exit code; -9 once its actor (or the actor's node) is gone; None while alive
        or while the actor does not answer in time."""
        try:
            return ray.get(self.handle.exited.remote(), timeout=_ASK_S)  # type: ignore[no-any-return]
        except ray.exceptions.GetTimeoutError:
            return None
        except ray.exceptions.RayActorError:
            return -9

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of its log, read on its node ("" if the actor is gone)."""
        try:
            return ray.get(self.handle.log_tail.remote(lines), timeout=_ASK_S)  # type: ignore[no-any-return]
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            return ""

    def stop(self) -> None:
        """Have the actor stop the server, then kill the actor (by handle); safe twice."""
        if self.stopped:
            return
        self.stopped = True
        # If the actor cannot stop it, its server ends with the actor (the death signal).
        with contextlib.suppress(ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            ray.get(self.handle.stop.remote(), timeout=_STOP_S)
        ray.kill(self.handle, no_restart=True)


class RayLauncher:
    """A Launcher (tracerl.engines.launch) starting each replica's server on a node that Ray
    picks: one SPREAD placement-group bundle per replica, one EngineActor in each."""

    def __init__(self, replicas: int, cfg: ClusterConfig, prefix: str) -> None:
        self.cfg, self.prefix = cfg, prefix
        bundle = {"CPU": cfg.engine_cpus} | ({"GPU": cfg.engine_gpus} if cfg.engine_gpus else {})
        self.pg = placement_group([bundle] * replicas, strategy="SPREAD")
        ready, _ = ray.wait([self.pg.ready()], timeout=cfg.place_timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise TimeoutError(f"Ray could not place {replicas} engine servers ({bundle} each)")
        self.servers: list[RemoteServer] = []
        self._closed = False

    def start(self, index: int, command: ServerCommand) -> Server:
        """Replica `index`'s server, started by a new actor in bundle `index`."""
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index)
        actor = EngineActor.options(  # type: ignore[attr-defined]
            name=f"{self.prefix}engine-{index}-{len(self.servers)}",
            num_cpus=self.cfg.engine_cpus, num_gpus=self.cfg.engine_gpus,
            scheduling_strategy=strategy,
        ).remote()  # fmt: skip
        try:
            info = ray.get(actor.start.remote(command), timeout=self.cfg.place_timeout_s)
        except BaseException:
            ray.kill(actor, no_restart=True)
            raise
        server = RemoteServer(actor, info)
        self.servers.append(server)
        return server

    def per_node(self) -> dict[str, int]:
        """Servers running (not stopped) on each node."""
        return dict(Counter(s.info.node for s in self.servers if not s.stopped))

    def close(self) -> None:
        """Stop any server still running (the engine stops its own first) and release the
        placement group; safe twice."""
        if self._closed:
            return
        self._closed = True
        for server in self.servers:
            server.stop()
        remove_placement_group(self.pg)
