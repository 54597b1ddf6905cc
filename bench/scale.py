"""Rollouts per second on one node and on two: do runners spread by Ray add throughput?

The agent (bench/scale_agent.py) makes a 0.5 s tool call, then runs the calculator example:
its rollouts wait on the tool, not on the CPU or the model, as agents calling real tools do.
A serving stack (the demo's tiny calculator model, engine and gateway, SQLite store) runs in
the driver; runner actors placed by tracerl.cluster run `rollouts` rollouts, first on one
node, then spread over two, with the same `per_node` concurrency on each node. Wall time
runs from the enqueue (the actors already up and polling, at most 1 s apart) to the last
finish. Runs inside namespaces of its own against a
simulated 2-node Ray cluster (tests/cluster/netns.py, as the tests do; needs root).

Also, unless --no-others: `store_claims_per_s_sqlite` / `store_claims_per_s_postgres` from
bench/store_backends.py and `dp_max_rel_diff` from bench/dp.py, each run small. The last
line printed is one JSON object.

    .venv/bin/python bench/scale.py [--rollouts 192 --per-node 8 --no-others]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

AGENT = f"{Path(__file__).with_name('scale_agent.py')}:run"


def _rollouts_per_s(nodes: int, rollouts: int, per_node: int, home: Path) -> float:
    """Rollouts per second of runner actors on `nodes` nodes, `per_node` slots on each."""
    from tests.cluster.common import MODEL
    from tracerl.cluster.config import ClusterConfig
    from tracerl.cluster.session import Cluster
    from tracerl.engines.config import EngineConfig
    from tracerl.examples import example_module
    from tracerl.pipeline.sources import Agents
    from tracerl.runner import RunnerConfig
    from tracerl.stack import start_stack
    from tracerl.types import Task

    tasks = example_module("calculator", "tasks").make_tasks(rollouts, "train", 0)
    db = Path(tempfile.mkdtemp()) / "store.db"
    stack = start_stack(home / "models" / MODEL, db, EngineConfig(max_batch_size=64))
    cfg = ClusterConfig(address=os.environ["RAY_ADDRESS"], nodes=nodes)
    cluster = Cluster(cfg, f"scale{nodes}")
    try:
        runner = RunnerConfig(concurrency=per_node)
        agents = Agents(stack.url, _unused_agent, None, runner)
        source = cluster.agents(agents, AGENT, None, str(db), stack).runner(stack.store)
        assert cluster.runners is not None
        cluster.runners.start()  # actors up and polling before the clock starts
        stack.store.add_tasks([Task.model_validate(t) for t in tasks])
        stack.store.enqueue([t["id"] for t in tasks])
        started = time.perf_counter()
        asyncio.run(source.run(until_idle=True))
        return rollouts / (time.perf_counter() - started)
    finally:
        cluster.close()
        stack.close()


async def _unused_agent(*args: Any) -> Any:
    raise AssertionError("the runner actors load the agent themselves")


def _last_json(cmd: list[str]) -> dict[str, Any]:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        print(out.stderr[-2000:], file=sys.stderr)
        return {}
    return json.loads(lines[-1])


def _others() -> dict[str, Any]:
    """The store and data-parallel benches' headline numbers, each run small."""
    py = sys.executable
    store = _last_json([py, "bench/store_backends.py", "--rollouts", "400"])
    dp = _last_json([py, "bench/dp.py", "--rows", "16", "--reps", "1"])
    return {
        "store_claims_per_s_sqlite": store.get("store_claims_per_s_sqlite"),
        "store_claims_per_s_postgres": store.get("store_claims_per_s_postgres"),
        "dp_max_rel_diff": dp.get("dp_max_rel_diff"),
    }


def inside(args: argparse.Namespace) -> None:
    """In the namespace, against the 2-node cluster: one node, then two."""
    home = Path(os.environ["TRACERL_HOME"])
    one = _rollouts_per_s(1, args.rollouts, args.per_node, home)
    two = _rollouts_per_s(2, args.rollouts, args.per_node, home)
    result = {
        "rollouts_per_s_1node": round(one, 2),
        "rollouts_per_s_2node": round(two, 2),
        "speedup": round(two / one, 2),
        "rollouts": args.rollouts,
        "per_node": args.per_node,
        "tool_latency_s": 0.5,
    }
    Path(args.out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=192)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--no-others", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.out:  # the second half, run by netns.py inside the namespace
        inside(args)
        return
    os.environ.setdefault("TRACERL_HOME", str(ROOT / ".tracerl"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "scale.json"
        cmd = [
            "unshare", "-n", "-p", "-f", "--mount-proc", "--kill-child", sys.executable,
            str(ROOT / "tests" / "cluster" / "netns.py"), __file__,
            "--rollouts", str(args.rollouts), "--per-node", str(args.per_node), "--out", str(out),
        ]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        result = json.loads(out.read_text())
    if not args.no_others:
        result |= _others()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
