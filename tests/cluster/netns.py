"""Run test scripts against a simulated 2-node Ray cluster, inside namespaces of its own.

Started by tests/test_cluster.py as `unshare -n -p -f --mount-proc --kill-child python
tests/cluster/netns.py` (root): this process is PID 1 of a fresh PID namespace in a network
namespace holding only `lo`. Ray rewrites 127.0.0.1 to a machine's external address and
listens there; here there is none, so nothing it starts can listen beyond loopback. It
brings `lo` up, starts a head node (resource `nodeA`) and a second node (`nodeB`) with `ray
start`, each with 2 CPUs and a 200 MB object store, then runs scripts with RAY_ADDRESS set:
`SCRIPT OUT` given as arguments, one run; else each `[SCRIPT, OUT]` JSON line of stdin in
turn, its output into OUT/log.txt and `done RC` on stdout after it (the test file starts
the cluster once for all its tests). At the end it kills every process of the namespace by
PID (Ray's included; never `ray stop`, which kills by name machine-wide). When this process
exits the kernel ends whatever is left in the namespace, so a failing test leaves nothing
behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PORT = 6390
ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def _env(temp: str) -> dict[str, str]:
    """Every Ray process gets the same settings: no auth token (a leftover ~/.ray/auth_token
    would turn it on), no usage stats, this checkout first on the path."""
    env = dict(os.environ)
    env["RAY_AUTH_MODE"] = "disabled"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["RAY_ADDRESS"] = f"127.0.0.1:{PORT}"
    env["TRACERL_RAY_TEMP"] = temp
    return env


def _ray_start(env: dict[str, str], temp: str, node: str, head: bool) -> None:
    common = [
        "--node-ip-address", "127.0.0.1", "--num-cpus", "2",
        "--object-store-memory", "200000000", "--disable-usage-stats",
        "--resources", json.dumps({node: 1}),
    ]  # fmt: skip
    if head:
        where = ["--head", "--port", str(PORT), "--temp-dir", temp, "--include-dashboard=false"]
    else:
        where = ["--address", f"127.0.0.1:{PORT}"]
    subprocess.run([RAY, "start", *where, *common], env=env, check=True, capture_output=True)


def _kill_the_rest() -> None:
    """SIGKILL every other process of this PID namespace (all of them are ours)."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def main() -> int:
    if os.getpid() != 1:
        raise SystemExit("run me with unshare -n -p -f --mount-proc (see the docstring)")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    temp = tempfile.mkdtemp(prefix="trc-", dir="/tmp")  # short: Ray's socket paths are long
    env = _env(temp)
    try:
        started = time.perf_counter()
        _ray_start(env, temp, "nodeA", head=True)
        _ray_start(env, temp, "nodeB", head=False)
        print(f"netns: 2-node Ray up in {time.perf_counter() - started:.1f}s", flush=True)
        if sys.argv[1:]:
            return subprocess.run([sys.executable, *sys.argv[1:]], env=env).returncode
        for line in sys.stdin:
            script, out = json.loads(line)  # paths may hold spaces
            with open(Path(out) / "log.txt", "w") as log:
                run = subprocess.run([sys.executable, script, out], env=env, stdout=log, stderr=log)
            print(f"done {run.returncode}", flush=True)
        return 0
    finally:
        _kill_the_rest()
        shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
