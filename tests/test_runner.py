"""The runner pool: rewards, agent failures and hangs, and a runner killed mid-rollout."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tracerl.agents import load_agent
from tracerl.engines.base import EngineUnavailable
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.runner import Runner, RunnerConfig
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store.sqlite import SqliteStore
from tracerl.types import ENGINE_OUTAGE, Generation, RolloutStatus, SamplingParams, Task

from .scripted import ScriptedEngine

ROOT = Path(__file__).resolve().parents[1]
AGENT = str(ROOT / "tests" / "agents" / "slow_agent.py")
REWARD = str(ROOT / "examples" / "calculator" / "reward.py") + ":reward"


@pytest.fixture
def stack(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[BackgroundServer, SqliteStore]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = SqliteStore(tmp_path / "traces.db")
    gateway = Gateway(
        store, {"policy": ServedModel("policy", ScriptedEngine(tokenizer), tokenizer)}
    )
    server = serve_in_thread(create_app(gateway))
    yield server, store
    server.stop()
    store.close()


def _tasks(store: SqliteStore, n: int) -> list[str]:
    tasks = [Task(id=f"t{i}", input={"question": "What is 37+48?"}, answer=85) for i in range(n)]
    store.add_tasks(tasks)
    return [r.id for r in store.enqueue([t.id for t in tasks])]


def _run(store: SqliteStore, url: str, spec: str, cfg: RunnerConfig) -> Runner:
    from tracerl.agents import load_callable

    with ThreadPoolExecutor(8) as threads:
        runner = Runner(store, url, load_agent(spec, threads), load_callable(REWARD), cfg)
        asyncio.run(runner.run(until_idle=True))
    return runner


def test_rollouts_get_rewards_and_spans(stack) -> None:  # type: ignore[no-untyped-def]
    server, store = stack
    ids = _tasks(store, 6)
    runner = _run(store, server.url, f"{AGENT}:run", RunnerConfig(concurrency=3))
    assert runner.finished == 6
    for rid in ids:
        r = store.get_rollout(rid)
        assert r.status == RolloutStatus.succeeded and r.reward == 1.0 and r.answer == "85"
        assert [s.seq for s in store.spans(rid)] == [0, 1]


def test_agent_errors_and_hangs_do_not_stop_the_pool(stack) -> None:  # type: ignore[no-untyped-def]
    server, store = stack
    _tasks(store, 2)
    _run(store, server.url, f"{AGENT}:crash", RunnerConfig(concurrency=2))
    failed = store.rollouts(status=RolloutStatus.failed)
    assert len(failed) == 2 and all("the agent broke" in (r.error or "") for r in failed)
    _tasks_more = [Task(id="h", input={"question": "?"}, answer=1)]
    store.add_tasks(_tasks_more)
    store.enqueue(["h", "t0"])
    _run(store, server.url, f"{AGENT}:hang", RunnerConfig(concurrency=2, timeout_s=0.5))
    timed_out = store.rollouts(status=RolloutStatus.timed_out)
    assert len(timed_out) == 2 and all("timed out" in (r.error or "") for r in timed_out)


class _Outage(ScriptedEngine):
    """The scripted engine with no replica in service for its first `down` calls."""

    def __init__(self, tokenizer, down: int) -> None:  # type: ignore[no-untyped-def]
        super().__init__(tokenizer)
        self.down = down

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if self.down > 0:
            self.down -= 1
            raise EngineUnavailable("no engine replica is in service")
        return await super().generate(prompt_ids, params)


def test_an_attempt_that_met_an_engine_outage_is_run_again_not_failed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The agent gives up on the 503 (no retries): finished, that would be a failure trained
    as reward 0. The gateway marks the attempt, the runner leaves it to be re-queued, and
    the next attempt succeeds."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = SqliteStore(tmp_path / "traces.db")
    gateway = Gateway(store, {"policy": ServedModel("policy", _Outage(tokenizer, 3), tokenizer)})
    server = serve_in_thread(create_app(gateway))
    try:
        ids = _tasks(store, 4)
        cfg = RunnerConfig(concurrency=4, outage_backoff_s=0.2)
        runner = _run(store, server.url, f"{AGENT}:run", cfg)
        rollouts = [store.get_rollout(i) for i in ids]
        assert [r.status for r in rollouts] == [RolloutStatus.succeeded] * 4
        assert all(r.reward == 1.0 for r in rollouts)
        rerun = [r for r in rollouts if r.attempt > 1]
        assert rerun and runner.reruns == sum(r.attempt - 1 for r in rollouts)
        for r in rerun:  # the first attempt carries the gateway's mark; the last one none
            assert any(m.name == ENGINE_OUTAGE for m in store.rewards(r.id, 1))
            assert not any(m.name == ENGINE_OUTAGE for m in store.rewards(r.id, r.attempt))
        assert runner.finished == 4
    finally:
        server.stop()
        store.close()


def test_command_agent(stack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server, store = stack
    ids = _tasks(store, 2)
    spec = f"cmd:{sys.executable} {ROOT / 'examples' / 'calculator' / 'agent.py'}"
    _run(store, server.url, spec, RunnerConfig(concurrency=2))
    for rid in ids:
        r = store.get_rollout(rid)
        assert r.status == RolloutStatus.succeeded and r.answer == "85" and r.reward == 1.0
        assert len(store.spans(rid)) == 2


def _runner_process(url: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "tracerl.cli",
        "runner",
        f"{AGENT}:run",
        "--url",
        url,
        "--reward",
        REWARD,
        "--runner.lease_s",
        "1.5",
        "--runner.concurrency",
        "4",
    ]
    return subprocess.Popen(cmd, env={**os.environ, **env}, cwd=ROOT)


@pytest.mark.slow
def test_killed_runner_rollouts_are_requeued_and_finished_once(stack) -> None:  # type: ignore[no-untyped-def]
    server, store = stack
    ids = _tasks(store, 4)
    doomed = _runner_process(server.url, {"SLOW_AGENT_SLEEP": "30"})
    deadline = time.monotonic() + 60
    while sum(len(store.spans(rid)) for rid in ids) < 4:  # every rollout is mid-flight
        assert time.monotonic() < deadline and doomed.poll() is None
        time.sleep(0.1)
    doomed.send_signal(signal.SIGKILL)
    doomed.wait()
    assert len(store.rollouts(status=RolloutStatus.running)) == 4
    rescuer = _runner_process(server.url, {"SLOW_AGENT_SLEEP": "0"})
    assert rescuer.wait(timeout=120) == 0
    for rid in ids:
        r = store.get_rollout(rid)
        assert r.status == RolloutStatus.succeeded and r.attempt == 2 and r.reward == 1.0
        assert [s.attempt for s in store.spans(rid)] == [2, 2]
        assert [s.seq for s in store.spans(rid)] == [0, 1]
        assert len(store.spans(rid, attempt=1)) == 1  # the dead attempt's call, kept apart
        assert len([w for w in store.rewards(rid) if w.span_seq is None]) == 1
    assert store.counts().get("succeeded") == 4


class _FlakyStore:
    """The store, unreachable for its first `outage` claims and counts (a store restarting)."""

    def __init__(self, store: SqliteStore, outage: int) -> None:
        self._store, self.outage = store, outage

    def _maybe_down(self) -> None:
        from tracerl.store import StoreUnavailable

        if self.outage > 0:
            self.outage -= 1
            raise StoreUnavailable("store unreachable (test)")

    def claim(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._maybe_down()
        return self._store.claim(*args, **kwargs)

    def counts(self):  # type: ignore[no-untyped-def]
        self._maybe_down()
        return self._store.counts()

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._store, name)


def test_a_pool_outlives_a_store_outage(stack) -> None:  # type: ignore[no-untyped-def]
    """Regression: a claim that could not reach a restarting store ended the runner process."""
    server, store = stack
    ids = _tasks(store, 3)
    flaky = _FlakyStore(store, outage=4)
    runner = _run(flaky, server.url, f"{AGENT}:run", RunnerConfig(concurrency=3, poll_s=0.01))
    assert flaky.outage == 0 and runner.finished == 3
    assert all(store.get_rollout(rid).status == RolloutStatus.succeeded for rid in ids)


def test_an_unreachable_remote_store_says_so() -> None:
    import socket

    from tracerl.store import StoreUnavailable
    from tracerl.store.client import StoreClient

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StoreUnavailable, match="unreachable"):
        StoreClient(f"http://127.0.0.1:{port}", timeout=2.0).counts()


def _broken_reward(task: dict, answer: str) -> float:
    """A reward function with a bug: it raises on every answer."""
    return {"85.0": 1.0}[answer]


def test_a_crashing_reward_function_is_no_reward_of_0_and_never_trained(stack) -> None:  # type: ignore[no-untyped-def]
    from tracerl.algorithms.advantages import GRPO
    from tracerl.algorithms.rows import rows_for
    from tracerl.pipeline.sources import read_finished
    from tracerl.types import Group

    server, store = stack
    ids = _tasks(store, 2)
    with ThreadPoolExecutor(4) as threads:
        agent = load_agent(f"{AGENT}:run", threads)
        runner = Runner(store, server.url, agent, _broken_reward, RunnerConfig(concurrency=2))
        asyncio.run(runner.run(until_idle=True))
    finished = [read_finished(store, store.get_rollout(rid)) for rid in ids]
    task = store.get_task(finished[0].rollout.task_id)
    group = Group(id="g", task=task, rollouts=finished)
    assert rows_for([group], GRPO()) == []  # not trained on as a reward of 0
    for f in finished:
        r = f.rollout
        assert r.status == RolloutStatus.failed and r.reward is None and r.answer == "85"
        assert not f.has_outcome and r.reward_failed
        # The user's bug, with its traceback: where it raised, and what.
        assert "_broken_reward" in (r.error or "") and "KeyError: '85'" in (r.error or "")
        assert store.spans(r.id)  # the agent's calls are kept in the store
    # An agent's own failure is still an outcome (trained as a failure).
    store.add_tasks([Task(id="c", input={"question": "?"}, answer=1)])
    (crashed,) = store.enqueue(["c"])
    _run(store, server.url, f"{AGENT}:crash", RunnerConfig(concurrency=1))
    after = read_finished(store, store.get_rollout(crashed.id))
    assert after.has_outcome and not after.rollout.reward_failed
