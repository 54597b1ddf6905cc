"""The replicas behind a server engine: which one serves a call, and which are in service.

Routing: a call with a routing key (the gateway passes the rollout id and role) goes to the
replica that served the key's first call, whose prefix cache holds the conversation so far;
a new key, a call without one, or a key whose replica is out of service goes to the replica
in service with the fewest calls in flight (ties rotate, so an idle set spreads its load).

Health: a replica whose server stopped answering is marked down and gets no call until the
engine's recovery marks it up again, serving the current weights. Weight sync marks a
replica `switching` while it drains and reloads.

One threading.Condition guards every field here: the gateway's event loop routes and counts
calls, the trainer's thread switches weights, a recovery thread brings a replica back.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["Replica", "ReplicaSet"]

STICKY_KEYS = 65_536
"""Routing keys remembered (least recently used forgotten first): far more than the
conversations in flight, so only finished ones are forgotten."""


@dataclass
class Replica:
    """One server and what the client knows of it; guarded by ReplicaSet.cond."""

    index: int
    """Position in the set (stable across restarts)."""
    url: str
    """Base URL of its server now (a restarted server may listen elsewhere)."""
    version: int
    """Version of the weights it serves now."""
    inflight: int = 0
    """Calls sent to it and not yet answered."""
    switching: bool = False
    """New weights are being loaded: no call may be sent."""
    up: bool = True
    """In service; False from the first failed call until it is back with current weights."""


class ReplicaSet:
    """Routing, admission and health marks of a server engine's replicas."""

    def __init__(self, urls: list[str], version: int) -> None:
        self.replicas = [Replica(i, url, version) for i, url in enumerate(urls)]
        self.cond = threading.Condition()
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._turn = 0

    def pick(self, key: str | None, avoid: Replica | None = None) -> Replica | None:
        """The replica for a call with routing key `key` (not `avoid`); None if none is up."""
        with self.cond:
            if key is not None:
                index = self._sticky.get(key)
                if index is not None and self._usable(self.replicas[index], avoid):
                    self._sticky.move_to_end(key)
                    return self.replicas[index]
            replica = self._least_loaded(avoid)
            if replica is not None and key is not None:
                self._sticky[key] = replica.index
                self._sticky.move_to_end(key)
                while len(self._sticky) > STICKY_KEYS:
                    self._sticky.popitem(last=False)
            return replica

    def enter(self, replica: Replica) -> int | None:
        """Count a call in on `replica` and return its version; None while it switches
        weights or is down (the caller picks again)."""
        with self.cond:
            if replica.switching or not replica.up:
                return None
            replica.inflight += 1
            return replica.version

    def leave(self, replica: Replica) -> None:
        """A call on `replica` was answered (or failed)."""
        with self.cond:
            replica.inflight -= 1
            self.cond.notify_all()

    def mark_down(self, replica: Replica) -> bool:
        """Take `replica` out of service; True if it was in service (recover it once)."""
        with self.cond:
            was_up, replica.up = replica.up, False
            self.cond.notify_all()
            return was_up

    def mark_up(self, replica: Replica, url: str, version: int) -> None:
        """Put `replica` back in service at `url`, serving `version`."""
        with self.cond:
            replica.url, replica.version, replica.up = url, version, True
            self.cond.notify_all()

    def drain(self, replica: Replica, timeout_s: float) -> bool:
        """Stop admitting calls on `replica` and wait until none is in flight (or it is
        down: its calls fail fast). False on timeout; call `undrain` either way."""
        with self.cond:
            replica.switching = True
            return self.cond.wait_for(lambda: replica.inflight == 0 or not replica.up, timeout_s)

    def undrain(self, replica: Replica, version: int | None) -> None:
        """Admit calls on `replica` again, now serving `version` (None: unchanged)."""
        with self.cond:
            if version is not None:
                replica.version = version
            replica.switching = False
            self.cond.notify_all()

    def up_replicas(self) -> list[Replica]:
        """The replicas in service now."""
        with self.cond:
            return [r for r in self.replicas if r.up]

    def _usable(self, replica: Replica, avoid: Replica | None) -> bool:
        return replica.up and replica is not avoid

    def _least_loaded(self, avoid: Replica | None) -> Replica | None:
        live = [r for r in self.replicas if self._usable(r, avoid)]
        if not live:
            return None
        n = len(self.replicas)
        turn = self._turn
        self._turn += 1
        # Fewest calls in flight; among equals, the next one after the last choice.
        return min(live, key=lambda r: (r.inflight, (r.index - turn) % n))
