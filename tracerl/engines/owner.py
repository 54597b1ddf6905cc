"""An engine server's watch on the process that started it.

Every server tracerl starts gets TRACERL_OWNER_PID, the pid of the process that started it
(launch.ServerCommand.start). When that process is gone, killed with SIGKILL say, which
runs no cleanup, the server stops its own process group. So no server outlives the run that
started it. PR_SET_PDEATHSIG cannot do this for every server: it fires when the *thread*
that started the child ends, and a replica's recovery thread restarts its server and then
ends. This module imports only the standard library: it also runs in the vLLM environment
(vllm_worker).
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["OWNER_PID", "watch_owner"]

OWNER_PID = "TRACERL_OWNER_PID"
"""The environment variable naming the process a server lives for."""
POLL_S = 1.0
"""How often the watch looks."""
GRACE_S = 10.0
"""How long the process group gets after SIGTERM before SIGKILL."""


def watch_owner() -> None:
    """Start the watch: a daemon thread that stops this process group once the process
    named by TRACERL_OWNER_PID is gone. Without the variable, nothing happens."""
    value = os.environ.get(OWNER_PID, "")
    if not value.isdigit():
        return
    args = (int(value), os.getppid())
    threading.Thread(target=_watch, args=args, name="tracerl-owner-watch", daemon=True).start()


def owner_gone(owner: int, parent_at_start: int) -> bool:
    """Whether `owner` has ended. A dead owner not yet reaped still answers signal 0, but a
    child of the owner is handed to another parent the moment the owner dies."""
    if parent_at_start == owner and os.getppid() != owner:
        return True
    try:
        os.kill(owner, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's: not ours to judge
        return False
    return False


def _watch(owner: int, parent_at_start: int) -> None:
    while not owner_gone(owner, parent_at_start):
        time.sleep(POLL_S)
    os.killpg(os.getpgrp(), signal.SIGTERM)  # a graceful stop, vLLM's engine core included
    time.sleep(GRACE_S)
    os.killpg(os.getpgrp(), signal.SIGKILL)
