"""tracerl: reinforcement learning for LLM agents from their traces."""

import os
import sys

# torch's OpenMP threads spin while waiting for work by default. tracerl runs an engine, a
# trainer, an HTTP server and many agent threads in one process on few cores: spinning
# threads starve the others (2-thread steps measured 5-17x slower beside another busy
# process). libgomp reads the policy when torch loads, so it must be set before that.
_OMP_SET_TOO_LATE = "OMP_WAIT_POLICY" not in os.environ and "torch" in sys.modules
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def ensure_passive_omp() -> None:
    """Re-run this program if torch was imported before tracerl could choose the policy.

    For scripts whose imports load torch first (import sorting puts it before tracerl).
    """
    if _OMP_SET_TOO_LATE:
        os.execv(sys.executable, [sys.executable, *sys.argv])
