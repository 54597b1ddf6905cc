"""`tracerl train` killed with SIGKILL mid-step resumes from its last checkpoint, with no
rollout trained twice and none lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tracerl.examples import example_module
from tracerl.pipeline.checkpoints import read_ledger
from tracerl.store.sqlite import SqliteStore
from tracerl.types import RolloutStatus

pytestmark = pytest.mark.slow
make_tasks = example_module("calculator", "tasks").make_tasks
ROOT = Path(__file__).resolve().parents[1]


def _train(tmp: Path, model: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tracerl.cli", "train", *extra]
    env = {**os.environ, "SLOW_AGENT_SLEEP": "0.3"}
    return subprocess.Popen(cmd, cwd=tmp, env=env)


def _args(tmp: Path, model: Path, train_tasks: int, *extra: str) -> list[str]:
    """A task file in tmp and the flags of a 4-step crash-test run."""
    tasks = tmp / "tasks.jsonl"
    rows = make_tasks(train_tasks, "train", 0) + make_tasks(8, "eval", 1)
    tasks.write_text("".join(json.dumps(t) + "\n" for t in rows))
    return [
        "--name", "crash", "--model", str(model), "--tasks", str(tasks),
        "--agent", f"{ROOT}/tests/agents/slow_agent.py:run",
        "--reward", f"{ROOT}/examples/calculator/reward.py:reward",
        "--pipeline.steps", "4", "--pipeline.tasks_per_step", "4", "--pipeline.group_size", "2",
        "--pipeline.eval_every", "0", "--no-eval_before", "--runner.lease_s", "2",
        # The random model never answers right; the check refusing an all-zero reward would
        # stop a run that is here to be killed and resumed.
        "--no-guard.preflight", *extra,
    ]  # fmt: skip


def _kill_when(proc: subprocess.Popen[bytes], run: Path, in_flight: Callable[[str], bool]) -> None:
    """SIGKILL `proc` once a checkpoint exists and a running rollout's group passes
    `in_flight`."""
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, "training ended before it could be killed"
        assert time.monotonic() < deadline
        if (run / "checkpoints" / "latest").exists() and (run / "traces.db").exists():
            store = SqliteStore(run / "traces.db")
            busy = [
                r
                for r in store.rollouts(status=RolloutStatus.running)
                if in_flight(r.group_id or "")
            ]
            store.close()
            if busy:
                break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_sigkill_mid_step_then_resume(tiny_model_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "runs" / "crash"
    proc = _train(tmp_path, tiny_model_dir, *_args(tmp_path, tiny_model_dir, 24))
    # Kill once step 1 is checkpointed and step 2's rollouts are being generated.
    _kill_when(proc, run, lambda group: "/step1/" in group)
    done_before = json.loads((run / "checkpoints" / "step-1" / "pipeline.json").read_text())
    assert done_before["step"] == 1

    resumed = _train(tmp_path, tiny_model_dir, "--resume", str(run))
    assert resumed.wait(timeout=300) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4
    trained = read_ledger(run)
    assert len(trained) == len(set(trained)), "a rollout was trained twice"
    store = SqliteStore(run / "traces.db")
    train_rollouts = [r for r in store.rollouts() if "/step" in (r.group_id or "")]
    assert len(train_rollouts) == 4 * 4 * 2  # each step's groups issued exactly once
    assert {r.id for r in train_rollouts} == set(trained), "a rollout was lost"
    assert all(r.status == RolloutStatus.succeeded for r in train_rollouts)
    interrupted = [r for r in train_rollouts if "/step1/" in (r.group_id or "")]
    assert any(r.attempt == 2 for r in interrupted)  # in flight at the kill, re-run once
    store.close()


def test_async_sigkill_with_rollouts_in_flight_then_resume(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    args = _args(
        tmp_path, tiny_model_dir, 40, "--pipeline.mode", "async", "--pipeline.max_staleness", "2"
    )
    run = tmp_path / "runs" / "crash"
    proc = _train(tmp_path, tiny_model_dir, *args)
    # Kill once a checkpoint exists and rollouts are in flight (generation never stops).
    _kill_when(proc, run, lambda group: True)
    latest = (run / "checkpoints" / "latest").read_text().strip()
    at_kill = json.loads((run / "checkpoints" / latest / "pipeline.json").read_text())
    ledger = [json.loads(line) for line in (run / "trained.jsonl").read_text().splitlines()]
    trained_at_kill = {
        i for line in ledger if line["step"] <= at_kill["step"] for i in line["rollouts"]
    }
    store = SqliteStore(run / "traces.db")
    completed = {r.id for r in store.rollouts(status=RolloutStatus.succeeded) if "/g" in r.group_id}
    in_flight = {r.id for r in store.rollouts(status=RolloutStatus.running)}
    store.close()

    resumed = _train(tmp_path, tiny_model_dir, "--resume", str(run))
    assert resumed.wait(timeout=300) == 0
    final = json.loads((run / "checkpoints" / "step-4" / "pipeline.json").read_text())
    trained = read_ledger(run)
    assert len(trained) == len(set(trained)), "a rollout was trained twice"
    assert trained_at_kill <= set(trained)
    assert final["rollouts_trained"] == len(trained)
    store = SqliteStore(run / "traces.db")
    source = final["source"]
    consumed = set(range(source["consumed_below"])) | set(source["consumed"])
    pending = {
        r.id
        for r in store.rollouts()
        if "/g" in r.group_id and int(r.group_id.split("/g")[1].split("-")[0]) not in consumed
    }
    lost = completed - set(trained) - pending
    # A rollout found too stale is not trained by design: its task is re-run in the same
    # group (stale = "requeue"), which then holds more rollouts than group_size (2).
    sizes = Counter(r.group_id for r in store.rollouts())
    superseded = {i for i in lost if sizes[store.get_rollout(i).group_id] > 2}
    assert not lost - superseded, f"completed rollouts neither trained nor pending: {lost}"
    requeued = [store.get_rollout(i) for i in in_flight]
    assert requeued and all(r.attempt >= 2 for r in requeued)  # re-run, not lost
    store.close()


def test_sigterm_stops_the_engine_servers_the_run_started(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`tracerl train` sent SIGTERM (kill, a scheduler) exits and takes its engine server
    processes with it: none is left running without a parent."""
    proc, ports = _training_on_servers(tmp_path, tiny_model_dir)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    assert not any(_server_running(port) for port in ports), "an engine server outlived the run"


def test_sigkill_leaves_no_engine_server_behind(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGKILL runs no cleanup in `tracerl train`: its servers notice their owner is gone
    (engines.owner) and stop themselves within seconds."""
    proc, ports = _training_on_servers(tmp_path, tiny_model_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while any(_server_running(port) for port in ports):
        assert time.monotonic() < deadline, "an engine server outlived the killed run"
        time.sleep(0.2)


def _training_on_servers(tmp: Path, model: Path) -> tuple[subprocess.Popen[bytes], list[str]]:
    """`tracerl train` with an `hf_server` engine, once it has trained a step; the ports of
    its servers."""
    logs = tmp / "engine-logs"
    extra = ("--engine.kind", "hf_server", "--engine.log_dir", str(logs))
    proc = _train(tmp, model, *_args(tmp, model, 40, *extra))
    run = tmp / "runs" / "crash"
    deadline = time.monotonic() + 240
    while not (run / "checkpoints" / "latest").exists():  # serving and training by now
        assert proc.poll() is None, "training ended before it could be stopped"
        assert time.monotonic() < deadline
        time.sleep(0.1)
    ports = [p.stem.rsplit("-", 1)[1] for p in logs.glob("hf_server-*.log")]
    assert ports and all(_server_running(port) for port in ports)
    return proc, ports


def _server_running(port: str) -> bool:
    """Whether a tracerl.engines.hf_server process serving `port` is alive."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:  # it exited while we looked
            continue
        if b"tracerl.engines.hf_server" in argv and port.encode() in argv:
            return True
    return False
