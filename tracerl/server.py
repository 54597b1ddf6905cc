"""Run an ASGI app with uvicorn in a background thread (demo, eval, tests, benches).

`tracerl serve` runs the same app in the foreground; this helper exists so one process can
host the gateway and the store while its runners and trainer work beside them.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class BackgroundServer:
    """A uvicorn server running in a daemon thread."""

    server: uvicorn.Server
    thread: threading.Thread
    url: str

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop accepting requests, let those in flight finish for up to `grace_s`, then
        cut them, and wait for the thread. Calling it again does nothing more."""
        self.server.should_exit = True
        self.thread.join(timeout=grace_s)
        if self.thread.is_alive():  # a request still running: close its connection
            self.server.force_exit = True
            self.thread.join(timeout=5)


def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> BackgroundServer:
    """Start `app` on host:port (a free port when 0) and return once it accepts requests."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="tracerl-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.002)
    bound = server.servers[0].sockets[0].getsockname()[1]  # the real port when 0 was asked
    return BackgroundServer(server, thread, f"http://{host}:{bound}")


@contextmanager
def serving(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """`serve_in_thread` as a context manager yielding the base URL; stops on exit."""
    background = serve_in_thread(app, host, port)
    try:
        yield background.url
    finally:
        background.stop()
