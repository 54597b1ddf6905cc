"""A 2-node run whose engine replicas Ray places, one on each node (run by netns.py; see
tests/test_cluster.py).

`python engines.py OUT`: a short calculator run with `engine.kind = "hf_server"`,
`engine.replicas = 2` and `cluster.address` set. Once it has trained a step it writes
OUT/ready.json (what listens inside the namespace, its interfaces; learn.py's look) and
OUT/servers.json (each engine server process, its parent, and the weight version it serves
once the first new weights are out), and gives the test outside a moment to look too.
OUT/result.json holds the summary, the cluster metrics per node (nodeA, nodeB) and the
policy versions of each training step's spans, and the engine servers left once the run
returned.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.cluster.common import calculator_config  # noqa: E402
from tests.cluster.learn import _look_inside, _named, _node_names  # noqa: E402
from tracerl.demo import write_calculator_tasks  # noqa: E402
from tracerl.metrics import read_metrics  # noqa: E402
from tracerl.pipeline.run import train  # noqa: E402


def _proc(pid: int) -> tuple[list[str], int]:
    """A process's command line and parent."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return [a for a in argv if a], ppid


def _engine_servers() -> list[dict[str, Any]]:
    """Every hf_server process of the namespace, its URL and its parent's command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv, ppid = _proc(int(entry.name))
            if "tracerl.engines.hf_server" not in argv:
                continue
            parent = " ".join(_proc(ppid)[0])
        except (OSError, IndexError):
            continue  # ended meanwhile
        host, port = argv[argv.index("--host") + 1], argv[argv.index("--port") + 1]
        found.append({
            "pid": int(entry.name), "ppid": ppid, "parent": parent, "url": f"http://{host}:{port}",
        })  # fmt: skip
    return found


def _record_servers(run_dir: Path, out: Path) -> None:
    """Once a step is trained (version 1 published): the servers, and the version each one
    reports (asked until both serve the new weights, 60 s at most)."""
    while not (run_dir / "trained.jsonl").exists():
        time.sleep(0.2)
    servers = _engine_servers()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for s in servers:
            s["weight_version"] = httpx.get(f"{s['url']}/health").json()["weight_version"]
        if all(s["weight_version"] != "0" for s in servers):
            break
        time.sleep(0.2)
    (out / "servers.json").write_text(json.dumps({"driver": os.getpid(), "servers": servers}))


def _span_versions(db: Path) -> dict[str, list[int]]:
    """step<N> -> the distinct policy versions of its training rollouts' spans."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute(
            "SELECT r.group_id, s.policy_version FROM spans s JOIN rollouts r "
            "ON r.id = s.rollout_id WHERE r.group_id LIKE '%/step%'"
        ).fetchall()
    versions: dict[str, set[int]] = {}
    for group, version in rows:
        versions.setdefault(group.split("/")[1], set()).add(int(version))
    return {step: sorted(v) for step, v in sorted(versions.items())}


def main() -> None:
    out = Path(sys.argv[1])
    runs = out / "runs"
    tasks = write_calculator_tasks(out / "tasks.jsonl", 40, 8)  # a short final evaluation
    cfg = calculator_config(
        runs, "engines", tasks=str(tasks), eval_before=False, guard={"preflight": False},
        pipeline={"steps": 2, "tasks_per_step": 4, "group_size": 4},
        engine={"kind": "hf_server", "replicas": 2, "log_dir": str(out / "engine-logs")},
        cluster={"address": os.environ["RAY_ADDRESS"]},
    )  # fmt: skip
    run_dir = runs / "engines"
    for look in (_look_inside, _record_servers):
        threading.Thread(target=look, args=(run_dir, out), daemon=True).start()
    summary = train(cfg)
    left = _engine_servers()  # the run stopped its servers' actors by handle
    names = _node_names()
    metrics = [
        {_named(k, names): v for k, v in m.items() if k.startswith("cluster/")}
        for m in read_metrics(run_dir / "metrics.jsonl")
        if any(k.startswith("cluster/") for k in m)
    ]
    result = {
        "summary": summary.model_dump(),
        "metrics": metrics,
        "span_versions": _span_versions(run_dir / "traces.db"),
        "servers_left": left,
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    placed = {k: v for k, v in metrics[-1].items() if "/engines/" in k}
    print(f"engine servers per node: {placed}; spans' versions: {result['span_versions']}")


if __name__ == "__main__":
    main()
