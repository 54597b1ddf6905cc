"""Engine servers kept in service: waited for until healthy, watched for a process that
exited or an engine that died, replaced on recovery, stopped on close.

A `Supervisor` holds one engine's servers (launch.py says how one starts: a child process
here, or a process on a cluster node). Its watch thread notices a server whose process
exited, or whose /health answers with an error while its process lives on (vLLM's API
server over a dead engine core answers 503 until it shuts down, or for good with
VLLM_KEEP_ALIVE_ON_ENGINE_DEATH), and reports the replica; the engine's recovery
(RemoteEngine.revive) then has the supervisor replace that server by a fresh one and waits
until it answers /health.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import httpx

__all__ = ["Server", "Supervisor", "wait_healthy"]

_WATCH_S = 0.5
"""How often the watch thread looks for servers whose process exited."""
_PROBE_S = 5.0
"""How often the watch thread asks each server's /health."""
_PROBE_TIMEOUT_S = 5.0
"""How long a /health probe waits: one not answered in time is a busy server, not a dead
one (only an answer that is an error condemns a server)."""


class Server(Protocol):
    """A started server as its engine sees it: here (ServerProcess) or on a cluster node."""

    url: str
    """Its base URL, reachable from this process."""
    log_path: Path
    """Its log, on the machine it runs on."""

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until it answers /health; on exit or timeout, stop it and raise."""
        ...

    def exited(self) -> int | None:
        """Its exit code once its process ended, else None."""
        ...

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of its log."""
        ...

    def stop(self) -> None:
        """Stop it and whatever it started."""
        ...


class Supervisor:
    """One engine's servers, by replica index: `start(index)` starts one (not yet ready),
    `on_failure(index, why)` hears of one whose process exited or whose /health fails."""

    def __init__(
        self,
        name: str,
        start: Callable[[int], Server],
        on_failure: Callable[[int, str], None],
        startup_timeout_s: float,
    ) -> None:
        self.name = name
        """Names the watch thread (<name>-watch)."""
        self.servers: list[Server] = []
        """The servers in service, by replica index."""
        self._start = start
        self._on_failure = on_failure
        self._startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()  # guards `servers` against close during a restart
        self._stopped = threading.Event()

    def start_all(self, replicas: int) -> list[str]:
        """Start `replicas` servers, wait until each is healthy, and return their URLs (on a
        failure the servers started so far stay listed: close stops them)."""
        for index in range(replicas):
            self.servers.append(self._start(index))
        for server in self.servers:
            server.wait_ready(self._startup_timeout_s)
        return [server.url for server in self.servers]

    def watch(self) -> None:
        """Start the watch thread (once the engine can take a replica out of service)."""
        threading.Thread(target=self._watch, name=f"{self.name}-watch", daemon=True).start()

    def _watch(self) -> None:
        """Report a replica whose server process exited, or whose /health answers with an
        error, even when no call is failing on it."""
        next_probe = time.monotonic() + _PROBE_S
        with httpx.Client(timeout=_PROBE_TIMEOUT_S) as client:
            while not self._stopped.wait(_WATCH_S):
                probe = time.monotonic() >= next_probe
                if probe:
                    next_probe = time.monotonic() + _PROBE_S
                with self._lock:
                    servers = list(enumerate(self.servers))
                for i, server in servers:
                    why = _failure(server, client if probe else None)
                    if why is not None and not self._stopped.is_set():
                        self._on_failure(i, why)

    def restart(self, index: int) -> str:
        """Replace the server of replica `index` by a fresh one, wait until it is ready, and
        return its URL."""
        with self._lock:
            if self._stopped.is_set():
                raise RuntimeError("engine is closed")
            self.servers[index].stop()
            server = self.servers[index] = self._start(index)
        server.wait_ready(self._startup_timeout_s)
        return server.url

    def log_tail(self, index: int) -> str:
        """The end of replica `index`'s server log ('' for a server not started here)."""
        return self.servers[index].log_tail() if index < len(self.servers) else ""

    def close(self) -> None:
        """Stop watching and restarting, and stop every server."""
        with self._lock:
            self._stopped.set()
            for server in self.servers:
                server.stop()


def _failure(server: Server, probe: httpx.Client | None) -> str | None:
    """Why `server` is out of service (its process exited; with `probe`, its /health
    answered an error), or None. A probe that gets no answer says nothing: the server may
    be busy, or starting (a replacement listens only once ready), or exiting (seen next)."""
    code = server.exited()
    if code is not None:
        return f"exited with code {code}"
    if probe is None:
        return None
    try:
        status = probe.get(f"{server.url}/health").status_code
    except httpx.HTTPError:
        return None
    return None if status == 200 else f"/health answered {status} (its engine is dead)"


def wait_healthy(server: Server, timeout_s: float) -> None:
    """Wait until `server` answers /health with 200; if it exits first or the time runs
    out, stop it and raise with the end of its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = server.exited()
        if code is not None:
            _fail(server, f"exited with code {code} while starting")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    _fail(server, f"did not answer /health within {timeout_s:.0f} s")


def _fail(server: Server, what: str) -> None:
    tail = server.log_tail()
    server.stop()
    where = f"server on {server.url} {what}; log {server.log_path}"
    raise RuntimeError(f"{where} ends with:\n{tail}")
