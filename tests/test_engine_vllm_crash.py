"""A training run on two vLLM replicas, one of them killed with SIGKILL mid-step.

The run must finish as if nothing happened: no rollout lost or trained twice, none re-run
(the killed replica's calls are retried on the other), and the killed replica restarted and
brought to the final weights. Skipped without the vLLM environment, as test_engine_vllm.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tracerl.engines.config import EngineConfig
from tracerl.engines.vllm import VLLMEngine
from tracerl.examples import example_file, example_module

from .test_engine_vllm import VLLM_PYTHON, _vllm_environment, calculator_h64, pytestmark  # noqa: F401


@pytest.fixture(scope="module")
def calculator_h64_dir() -> Path:
    """The head-size-64 calculator model test_engine_vllm serves."""
    return calculator_h64()


def test_training_goes_on_when_a_replica_is_killed(
    calculator_h64_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3 steps x 4 tasks x 2 on two vLLM replicas; one is SIGKILLed with calls in flight
    during step 2. The run finishes; every rollout is trained exactly once, none re-run (its
    calls were retried on the other replica); the killed replica is restarted and serves
    the final weights before the run shuts down."""
    from tracerl.pipeline import run as run_module
    from tracerl.pipeline.checkpoints import read_ledger
    from tracerl.pipeline.config import TrainConfig
    from tracerl.stack import LocalStack
    from tracerl.store.sqlite import SqliteStore
    from tracerl.types import RolloutStatus

    seen: dict[str, Any] = {}
    start = run_module.start_roles_stack

    def capture(*args: Any, **kwargs: Any) -> LocalStack:
        stack = start(*args, **kwargs)
        seen["stack"], close = stack, stack.close

        def close_after_checking() -> None:
            seen["end"] = _replicas_once_all_back(stack.engine)  # type: ignore[arg-type]
            close()

        stack.close = close_after_checking  # type: ignore[method-assign]
        return stack

    monkeypatch.setattr(run_module, "start_roles_stack", capture)
    killer = threading.Thread(target=_kill_replica_mid_step, args=(seen,), daemon=True)
    killer.start()
    tasks = tmp_path / "tasks.jsonl"
    make_tasks = example_module("calculator", "tasks").make_tasks
    rows = make_tasks(12, "train", 0) + make_tasks(8, "eval", 1)
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    engine = EngineConfig(
        kind="vllm", replicas=2, python=str(VLLM_PYTHON), kv_cache_gib=0.25,
        log_dir=str(tmp_path / "logs"),
    )  # fmt: skip
    cfg = TrainConfig(
        name="replica-crash", runs=str(tmp_path / "runs"), model=str(calculator_h64_dir),
        agent=f"{example_file('calculator', 'agent')}:run",
        reward=f"{example_file('calculator', 'reward')}:reward", tasks=str(tasks),
        eval_before=False, engine=engine,
        pipeline={"steps": 3, "tasks_per_step": 4, "group_size": 2, "eval_every": 0},
    )  # fmt: skip
    summary = run_module.train(cfg)
    killer.join(timeout=1)

    assert "killed" in seen, "no replica was killed mid-run"
    print(f"killed with {seen['inflight']} calls in flight; at the end: {seen['end']}")
    assert summary.steps == 3
    run_dir = Path(summary.run_dir)
    trained = read_ledger(run_dir)
    assert len(trained) == len(set(trained)), "a rollout was trained twice"
    store = SqliteStore(run_dir / "traces.db")
    train_rollouts = [r for r in store.rollouts() if "/step" in (r.group_id or "")]
    store.close()
    assert len(train_rollouts) == 3 * 4 * 2
    assert {r.id for r in train_rollouts} == set(trained), "a rollout was lost"
    assert all(r.status == RolloutStatus.succeeded and r.attempt == 1 for r in train_rollouts)
    end = seen["end"]
    assert seen["stack"].engine.servers[0] is not seen["killed"], "not restarted"
    assert end["recoveries"] >= 1 and end["restarted_alive"]
    assert end["versions"] == [3, 3] and end["policy_version"] == 3
    assert end["same_greedy"], "the restarted replica serves other weights than its twin"


def _kill_replica_mid_step(seen: dict[str, Any]) -> None:
    """SIGKILL replica 0 once step 2's rollouts run and it has calls in flight."""
    from tracerl.types import RolloutStatus

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        stack = seen.get("stack")
        if stack is not None:
            engine, replica = stack.engine, stack.engine.replicas.replicas[0]
            running = stack.store.rollouts(status=RolloutStatus.running)
            if replica.inflight > 0 and any("/step1/" in (r.group_id or "") for r in running):
                seen["inflight"], seen["killed"] = replica.inflight, engine.servers[0]
                os.kill(engine.servers[0].process.pid, signal.SIGKILL)
                return
        time.sleep(0.005)


def _replicas_once_all_back(engine: VLLMEngine) -> dict[str, Any]:
    """Wait (bounded) for the killed replica's return; what each replica serves then."""
    deadline = time.monotonic() + 300
    while engine.recoveries < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    prompt = [engine.eos_token_ids[0], *engine.tokenizer.encode("What is 12+30?")]
    gens = [engine.generate_sync(i, prompt, max_tokens=16) for i in range(2)]
    return {
        "recoveries": engine.recoveries,
        "restarted_alive": engine.servers[0].process.poll() is None,
        "versions": [r.version for r in engine.replicas.replicas],
        "policy_version": engine.policy_version,
        "same_greedy": gens[0].completion_ids == gens[1].completion_ids
        and max(abs(a - b) for a, b in zip(gens[0].logprobs, gens[1].logprobs, strict=True))
        <= 1e-4,
    }
