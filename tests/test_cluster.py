"""A run past one machine: Ray places the runners and trainer ranks (tracerl.cluster).

Each test runs a script of tests/cluster/ against a simulated 2-node Ray cluster (`ray
start --head` with resource nodeA, `ray start --address` with nodeB), started once for the
file, inside network and PID namespaces of its own (tests/cluster/netns.py): Ray listens on
a machine's external address, and in a namespace holding only `lo` there is none. Needs
root (unshare), `ip`, `ss`, Ray, and the demo's calculator model in $TRACERL_HOME (the
fixture builds it once if missing).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.needs import missing
from tracerl.pipeline.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "cluster"


@pytest.fixture(autouse=True)
def _namespaces() -> None:
    _can_run_a_cluster()


def _can_run_a_cluster() -> None:
    """The cluster runs in namespaces of its own: root, unshare and ss (and Ray) needed."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ss"):
        missing("ray", "needs root, unshare and ss (the cluster runs in namespaces of its own)")
    try:
        import ray  # noqa: F401
    except ImportError:
        missing("ray", "ray is not installed (pip install -e '.[dev]')")


def on_a_cluster(test: Callable[..., None]) -> Callable[..., None]:
    """Marks of a test that trains on the simulated cluster."""
    return pytest.mark.ray(pytest.mark.slow(test))


class Cluster:
    """The 2-node cluster in namespaces of its own (tests/cluster/netns.py), started once for
    this file's tests (Ray's start is ~16 s of a quiet machine's time, more under load): each
    test runs its script on it, in turn. `proc` is the `unshare` process; killing it ends the
    namespace's PID 1, and the kernel every process of the namespace (--kill-child)."""

    def __init__(self) -> None:
        cmd = [
            "unshare", "-n", "-p", "-f", "--mount-proc", "--kill-child",
            sys.executable, str(SCRIPTS / "netns.py"),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("")  # the namespace ended

    def start(self, script: str, out: Path) -> None:
        """Run tests/cluster/<script> OUT next (netns.py reads one line a script)."""
        assert self.proc.poll() is None and self.proc.stdin is not None, "the cluster is gone"
        self.proc.stdin.write(json.dumps([str(SCRIPTS / script), str(out)]) + "\n")
        self.proc.stdin.flush()

    def finish(self, out: Path, timeout_s: float = 540) -> str:
        """The script's output once it exits 0 (within the tests' own 600 s limit). A script
        that hangs takes the cluster with it: the tests after it fail, none hangs."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.close(kill=True)
                pytest.fail(f"timed out:\n{_log(out)}")
            if not line:
                pytest.fail(f"the cluster ended:\n{_log(out)}")
            if line.startswith("done "):
                break
            print(line)  # netns.py's own lines: Ray's start time
        log = _log(out)
        assert line == "done 0", log
        return log

    def run_and_look(self, script: str, out: Path) -> tuple[set[int], set[int]]:
        """Run `script`; once it writes OUT/ready.json (it trains), look from outside the
        namespace: the cluster's processes, and those of them listening in the host's."""
        self.start(script, out)
        _wait_for(out / "ready.json", self, timeout_s=400)
        ours = _descendants(self.proc.pid)
        leaked = ours & _host_listeners()
        (out / "checked").touch()
        print(self.finish(out))
        return ours, leaked

    def close(self, kill: bool = False) -> None:
        """End of the file: netns.py kills the namespace's processes and exits."""
        if self.proc.poll() is None and not kill:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _log(out: Path) -> str:
    path = out / "log.txt"
    return path.read_text()[-3000:] if path.exists() else "(no log)"


@pytest.fixture(scope="module")
def cluster(calculator_model_dir: Path) -> Iterator[Cluster]:
    """One cluster for the file. The fault test kills nodeB: it stays the file's last."""
    _can_run_a_cluster()  # before the autouse check: a module fixture is set up first
    started = Cluster()
    yield started
    started.close()


def _descendants(root: int) -> set[int]:
    """Host PIDs of `root` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" ", 1)
        except OSError:
            continue
        ppid = int(rest.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(pid))
    seen, todo = set(), [root]
    while todo:
        pid = todo.pop()
        seen.add(pid)
        todo += children.get(pid, [])
    return seen


def _host_listeners() -> set[int]:
    """PIDs owning a listening TCP socket in the host's network namespace."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return {int(p.split(",")[0]) for p in out.split("pid=")[1:]}


def _wait_for(path: Path, cluster: Cluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if cluster.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{path.name} never appeared:\n{_log(path.parent)}")
        time.sleep(0.2)


def test_cluster_config_is_off_by_default_and_ray_free() -> None:
    """Without cluster.address nothing changes, and reading the config imports no Ray."""
    code = "import sys, tracerl.pipeline.config as c; c.TrainConfig(); print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr
    assert TrainConfig().cluster.address == ""
    cfg = TrainConfig.model_validate({"cluster": {"address": "127.0.0.1:6379"}})
    assert cfg.cluster.address == "127.0.0.1:6379"


@on_a_cluster
def test_two_nodes_learn_like_one_process_and_listen_on_loopback_only(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Outside the namespace, while the cluster run trains: nothing of ours listens here.
    ours, leaked = cluster.run_and_look("learn.py", tmp_path)
    assert len(ours) > 10, "the namespace's processes were not seen from the host"
    assert not leaked, f"processes of the cluster listen in the host's namespace: {leaked}"
    inside = json.loads((tmp_path / "ready.json").read_text())
    assert [line.split(":")[1].strip() for line in inside["links"].splitlines()] == ["lo"]
    local = [line.split()[3] for line in inside["listen"].splitlines()]
    assert local and all(a.rsplit(":", 1)[0] in LOOPBACK for a in local), local
    assert '"python"' in inside["listen"] and '"raylet"' in inside["listen"]

    result = json.loads((tmp_path / "result.json").read_text())
    one, two = result["one"], result["cluster"]
    assert two["steps"] == 5 and two["rollouts_trained"] == one["rollouts_trained"] == 5 * 8 * 8
    assert two["success_after"] >= two["success_before"] + 0.2, two
    assert abs(two["success_after"] - one["success_after"]) <= 0.2, (one, two)
    # Runners ran on both nodes, one actor each, and the metrics say so every step.
    metrics = result["metrics"]
    assert len(metrics) == 5
    for step in metrics:
        assert step["cluster/nodes"] == 2
        assert step["cluster/runners/nodeA"] == step["cluster/runners/nodeB"] == 1
    last = metrics[-1]
    assert last["cluster/rollouts/nodeA"] > 0 and last["cluster/rollouts/nodeB"] > 0
    assert last["cluster/rollouts/nodeA"] + last["cluster/rollouts/nodeB"] >= 5 * 8 * 8


LOOPBACK = {"127.0.0.1", "[::ffff:127.0.0.1]", "[::1]"}


@on_a_cluster
def test_engine_replicas_run_one_per_node_and_serve_each_step_s_weights(
    cluster: Cluster, tmp_path: Path
) -> None:
    _, leaked = cluster.run_and_look("engines.py", tmp_path)
    assert not leaked, f"processes of the cluster listen in the host's namespace: {leaked}"
    inside = json.loads((tmp_path / "ready.json").read_text())
    local = [line.split()[3] for line in inside["listen"].splitlines()]
    assert local and all(a.rsplit(":", 1)[0] in LOOPBACK for a in local), local

    # Each replica's server is a child of a Ray actor (not of the training process), and
    # both serve new weights once step 1's are published.
    seen = json.loads((tmp_path / "servers.json").read_text())
    servers = seen["servers"]
    assert len(servers) == 2 and len({s["ppid"] for s in servers}) == 2, servers
    assert all(s["ppid"] != seen["driver"] and s["parent"].startswith("ray::") for s in servers)
    assert all(s["url"].startswith("http://127.0.0.1:") for s in servers), servers
    assert all(s["weight_version"] in ("1", "2") for s in servers), servers

    result = json.loads((tmp_path / "result.json").read_text())
    assert result["summary"]["steps"] == 2
    assert result["summary"]["rollouts_trained"] == 2 * 4 * 4
    # The metrics place one replica on each node, every step.
    metrics = result["metrics"]
    assert len(metrics) == 2
    for step in metrics:
        assert step["cluster/engines/nodeA"] == step["cluster/engines/nodeB"] == 1, step
    # Weight sync reached the remote replicas: step 1 was generated by version 1 only.
    assert result["span_versions"] == {"step0": [0], "step1": [1]}
    assert result["servers_left"] == [], "an engine server outlived the run"


@on_a_cluster
def test_a_node_killed_mid_step_loses_nothing_and_trains_nothing_twice(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The file's last test: nodeB stays dead after it."""
    cluster.start("fault.py", tmp_path)
    print(cluster.finish(tmp_path))
    result = json.loads((tmp_path / "result.json").read_text())
    kill, rollouts, ledger = result["kill"], result["rollouts"], result["ledger"]
    assert kill["running"] > 0 and kill["actor_pids"], kill
    assert result["summary"]["steps"] == 3
    # 0 lost: every training rollout ended with an outcome, every group complete.
    statuses = Counter(r["status"] for r in rollouts)
    assert set(statuses) == {"succeeded"}, statuses
    groups = Counter(r["group_id"] for r in rollouts)
    assert set(groups.values()) == {result["group_size"]}
    # The killed node's rollouts were run again (a dead runner's lease expired).
    assert any(r["attempt"] > 1 for r in rollouts), "no rollout was re-run after the kill"
    # 0 trained twice: the ledger names each rollout once, and only finished ones.
    assert len(ledger) == len(set(ledger)) == 3 * 8 * 4
    assert set(ledger) <= {r["id"] for r in rollouts}
    # The metrics saw nodeB's runner go, and nodeA's keep going.
    first, last = result["metrics"][0], result["metrics"][-1]
    assert sorted(v for k, v in first.items() if "/runners/" in k) == [1, 1]
    assert sorted(v for k, v in last.items() if "/runners/" in k) == [0, 1]
    assert last["cluster/nodes"] == 1
