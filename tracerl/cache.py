"""The cache of built models ($TRACERL_HOME, else ~/.cache/tracerl) and its build locks.

Models tracerl builds (the demo's start, the long-context test model, a converted pretrained
model) are built once and kept here. Two processes may want the same one at once (two test
sessions, a demo beside a test run): `build_lock` lets one build while the other waits, then
finds it built. Torch-free: configs and the CLI read `cache_dir`.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["build_lock", "cache_dir"]


def cache_dir() -> Path:
    """Where built models are kept: $TRACERL_HOME, else ~/.cache/tracerl."""
    return Path(os.environ.get("TRACERL_HOME", Path.home() / ".cache" / "tracerl"))


@contextmanager
def build_lock(key: str) -> Iterator[None]:
    """Hold the build lock named `key` in the models cache (blocks while another process
    holds it). Builds under other keys go on meanwhile."""
    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    with open(models / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
