"""`tracerl dashboard --runs runs`: the live web page of the runs in a folder (loopback
only), until interrupted."""

from __future__ import annotations

import os
import time

from rich.console import Console

from tracerl.dashboard.app import create_app
from tracerl.dashboard.config import DashboardCommand
from tracerl.server import serve_in_thread


def main(cfg: DashboardCommand, console: Console) -> None:
    """Serve the page and its API, print where."""
    server = serve_in_thread(create_app(cfg.runs), cfg.host, cfg.port)
    guard = "admin key ($TRACERL_ADMIN_KEY)" if os.environ.get("TRACERL_ADMIN_KEY") else "open"
    console.print(f"dashboard: {server.url}/ · runs in {cfg.runs}/ · control: {guard}")
    try:
        while server.thread.is_alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
