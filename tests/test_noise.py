"""Tool noise (tracerl.noise): the schedule, the rates it is applied at, and its record."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tracerl import noise
from tracerl.agents import python_agent
from tracerl.export import parse_filter, select_rows
from tracerl.runner import Runner, RunnerConfig
from tracerl.store.sqlite import SqliteStore
from tracerl.types import PolicyVersion, Task

RESULT = "12345"
CALLS = 10


def test_probability_ramps_linearly_then_holds() -> None:
    cfg = noise.NoiseConfig(p0=0.1, p1=0.5, ramp_steps=4)
    assert [cfg.probability(s) for s in (0, 1, 2, 4, 9)] == pytest.approx([0.1, 0.2, 0.3, 0.5, 0.5])
    assert noise.NoiseConfig(p1=0.3).probability(100) == 0.3
    assert not noise.NoiseConfig().enabled


def test_each_kind_perturbs_as_described() -> None:
    base = {"id": "r/0", "p": 1.0, "delay_s": 0.0, "error_text": "tool down", "seed": 3}
    seen = {}
    for kind in ("drop", "corrupt", "error", "delay"):
        spec = noise.NoiseSpec(**base, kinds=[kind])
        seen[kind] = noise.ToolNoise(spec).perturb(RESULT)
    assert seen["drop"] == "" and seen["error"] == "tool down" and seen["delay"] == RESULT
    changed = [a != b for a, b in zip(seen["corrupt"], RESULT, strict=True)]
    assert sum(changed) == 1 and seen["corrupt"].isdigit()
    assert noise.take_applied("r/0") == ["drop", "corrupt", "error", "delay"]
    # Nothing numeric to corrupt: the tool fails instead, and that is what is counted.
    spec = noise.NoiseSpec(**{**base, "id": "r/1"}, kinds=["corrupt"])
    assert noise.ToolNoise(spec).perturb("none") == "tool down"
    assert noise.take_applied("r/1") == ["error"]


def _agent(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    """Calls its tool CALLS times; answers how many results came back changed."""
    tools = noise.wrap({"lookup": lambda: RESULT}, task)
    return str(sum(tools["lookup"]() != RESULT for _ in range(CALLS)))


def _run(store: SqliteStore, cfg: noise.NoiseConfig, n: int) -> None:
    tasks = [Task(id=f"t{i}", input={"q": i}) for i in range(n)]
    store.add_tasks(tasks)
    store.enqueue([t.id for t in tasks])
    with ThreadPoolExecutor(4) as threads:
        runner = Runner(store, "http://unused", python_agent(_agent, threads), None,
                        RunnerConfig(concurrency=4, noise=cfg))  # fmt: skip
        asyncio.run(runner.run(until_idle=True))


def test_runner_applies_the_scheduled_rate_and_records_it(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "traces.db")
    cfg = noise.NoiseConfig(p0=0.0, p1=1.0, ramp_steps=10, kinds=["drop", "corrupt", "error"])
    store.publish_version(PolicyVersion(version=3))  # step 3 of 10: p = 0.3
    _run(store, cfg, 200)
    rollouts = store.rollouts()
    counts = {}
    for r in rollouts:
        (record,) = [w for w in store.rewards(r.id) if w.name == noise.NOISE_REWARD]
        counts[r.id] = record.value
        assert record.value == int(r.answer or "-1")  # what the agent saw is what is recorded
        assert r.reward is None  # the count never becomes the rollout's reward
    rate = sum(counts.values()) / (CALLS * len(rollouts))
    assert rate == pytest.approx(0.3, abs=0.04)
    clean = select_rows(store, parse_filter("noise == 0"))
    assert clean == []  # no spans: nothing to train on, but the filter parses and runs
    store.close()


def test_fraction_leaves_rollouts_clean(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "traces.db")
    _run(store, noise.NoiseConfig(p1=1.0, fraction=0.25, kinds=["error"]), 200)
    noisy = [r for r in store.rollouts() if r.answer == str(CALLS)]
    clean = [r for r in store.rollouts() if r.answer == "0"]
    assert len(noisy) + len(clean) == 200
    assert len(noisy) / 200 == pytest.approx(0.25, abs=0.08)
    store.close()


def test_calculator_agent_uses_the_hook() -> None:
    from tracerl.examples import example_module

    agent = example_module("calculator", "agent")
    assert agent.tools_for({"question": "1+1"})["calculator"]("2*21") == "42"
    spec = noise.spec_for(noise.NoiseConfig(p1=1.0, kinds=["error"]), "r9", 0, 0)
    noisy = agent.tools_for({"question": "1+1", noise.SPEC_KEY: spec.model_dump()})
    assert noisy["calculator"]("2*21") == noise.NoiseConfig().error_text
    assert noise.take_applied(spec.id) == ["error"]
