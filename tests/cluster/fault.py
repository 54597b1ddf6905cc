"""A node dies mid-step and the run still finishes, nothing lost, nothing trained twice (run
by netns.py; see tests/test_cluster.py).

`python fault.py OUT`: a cluster run of the calculator agent slowed to ~1 s per rollout
(so rollouts are in flight when the node dies) with 3 s leases. As soon as a rollout of
step 1 or later runs on nodeB, the runner actors of nodeB and then nodeB's raylet are killed
with SIGKILL. Their rollouts stay `running` until the leases expire; nodeA's runner
re-queues them on its next claim and runs them again. OUT/result.json holds the summary, the
kill, every training rollout's final state, and the ledger of trained rollout ids.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.cluster.common import calculator_config  # noqa: E402
from tracerl.metrics import read_metrics  # noqa: E402
from tracerl.pipeline.checkpoints import read_ledger  # noqa: E402
from tracerl.pipeline.run import train  # noqa: E402
from tracerl.store import SqliteStore  # noqa: E402

SLOW_AGENT = Path(__file__).with_name("slow_calculator.py")


def _node_b() -> str:
    """nodeB's id, 8 hex digits (the runner ids' suffix)."""
    return next(n["NodeID"][:8] for n in ray.nodes() if "nodeB" in n["Resources"])


def _running_on(db: Path, node: str) -> int:
    """Training rollouts running on `node` now (read-only look at the run's SQLite store)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
        row = con.execute(
            "SELECT count(*) FROM rollouts WHERE status = 'running' AND runner_id LIKE ? "
            "AND group_id NOT LIKE '%/step0/%'",
            (f"%@{node}",),
        ).fetchone()
    return int(row[0])


def _kill_node_b(run_dir: Path, kill: dict[str, Any]) -> None:
    """Wait for nodeB to be running a rollout of step 1+, then SIGKILL its runners and raylet."""
    while not ray.is_initialized() or not (run_dir / "trained.jsonl").exists():
        time.sleep(0.1)
    node = _node_b()
    while _running_on(run_dir / "traces.db", node) == 0:
        time.sleep(0.05)
    infos = [
        ray.get(ray.get_actor(a["name"], namespace=a["namespace"]).info.remote())
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "/runner-" in a["name"]
    ]
    victims = [i for i in infos if i.node == node]
    kill["running"] = _running_on(run_dir / "traces.db", node)
    kill["actor_pids"] = [i.pid for i in victims]
    kill["raylet_pid"] = victims[0].raylet_pid
    for pid in [*kill["actor_pids"], kill["raylet_pid"]]:
        os.kill(pid, signal.SIGKILL)
    kill["at"] = time.time()


def main() -> None:
    out = Path(sys.argv[1])
    runs = out / "runs"
    cfg = calculator_config(
        runs, "fault", agent=f"{SLOW_AGENT}:run", eval_before=False,
        pipeline={"steps": 3}, runner={"lease_s": 3.0, "concurrency": 4},
        cluster={"address": os.environ["RAY_ADDRESS"]},
    )  # fmt: skip
    kill: dict[str, Any] = {}
    killer = threading.Thread(target=_kill_node_b, args=(runs / "fault", kill), daemon=True)
    killer.start()
    summary = train(cfg)
    store = SqliteStore(runs / "fault" / "traces.db")
    training = [r for r in store.rollouts() if "/step" in (r.group_id or "")]
    result = {
        "summary": summary.model_dump(),
        "kill": kill,
        "rollouts": [r.model_dump(mode="json") for r in training],
        "ledger": read_ledger(runs / "fault"),
        "group_size": cfg.pipeline.group_size,
        "metrics": [
            {k: v for k, v in m.items() if k.startswith("cluster/")}
            for m in read_metrics(runs / "fault" / "metrics.jsonl")
            if any(k.startswith("cluster/") for k in m)
        ],
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
