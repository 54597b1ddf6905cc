"""Internalization: training rollouts carry the asset with a probability that falls over the
run, drawn per rollout and seeded; held-out evaluations run without it; the metrics log the
share that carried it; and every span's prompt holds the asset exactly when it says so."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.assets_world import reward, tasks
from tracerl.agents import AgentResult
from tracerl.assets.config import CurriculumConfig
from tracerl.assets.curriculum import Curriculum
from tracerl.store import SqliteStore
from tracerl.types import UNASSISTED, Task


def test_the_probability_falls_linearly_then_stays() -> None:
    c = CurriculumConfig(name="fmt", start=1.0, end=0.2, steps=4)
    assert [c.probability(s) for s in range(6)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    with pytest.raises(ValueError):
        CurriculumConfig(name="fmt", start=1.5)
    with pytest.raises(ValueError):
        CurriculumConfig(name="no@version")


def test_each_rollout_is_drawn_and_the_draws_are_seeded() -> None:
    store = SqliteStore()
    store.add_tasks([Task(id="t", input={})])
    step = [0]
    cfg = CurriculumConfig(name="fmt", start=1.0, end=0.0, steps=2, seed=5)
    c = Curriculum(cfg, version=3, step=lambda: step[0])
    first = c.enqueue(store, ["t"] * 8, "g0", 3)
    assert [r.assets for r in first] == [{"fmt": 3}] * 8
    step[0] = 1
    middle = c.enqueue(store, ["t"] * 200, "g1", 3)
    carried = sum(r.assets == {"fmt": 3} for r in middle)
    assert 70 < carried < 130 and {r.group_id for r in middle} == {"g1"}
    assert c.values() == {
        "assets/version": 3, "assets/probability": pytest.approx((8 * 1.0 + 200 * 0.5) / 208),
        "assets/carried": pytest.approx((8 + carried) / 208),
    }  # fmt: skip
    assert c.values()["assets/carried"] is None  # nothing issued since
    # Another run of the same config draws the same for each rollout.
    again = Curriculum(cfg, version=3, step=lambda: 1).enqueue(store, ["t"] * 200, "g1", 3)
    assert sum(r.assets == {"fmt": 3} for r in again) == carried
    other_seed = cfg.model_copy(update={"seed": 6})
    moved = Curriculum(other_seed, 3, lambda: 1).enqueue(store, ["t"] * 200, "g1", 3)
    assert sum(r.assets == {"fmt": 3} for r in moved) != carried
    step[0] = 2
    assert all(r.assets == {"fmt": 0} for r in c.enqueue(store, ["t"] * 8, "g2", 3))
    store.close()


async def short_agent(task: Task, base_url: str, api_key: str, model: str) -> AgentResult:
    """One short call, no system message of its own."""
    async with httpx.AsyncClient(timeout=60) as http:
        resp = await http.post(
            f"{base_url}/chat/completions",
            json={
                "model": model,
                "max_tokens": 3,
                "messages": [{"role": "user", "content": f"n={task.input['n']}"}],
            },  # fmt: skip
        )
    resp.raise_for_status()
    return AgentResult(resp.json()["choices"][0]["message"]["content"] or "")


def test_a_training_run_withdraws_the_asset_and_evaluates_without_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tracerl.pipeline.config import TrainConfig
    from tracerl.pipeline.run import train

    store_path = tmp_path / "traces.db"
    store = SqliteStore(store_path)
    text = store.put_asset("fmt", "Answer with twice n.").text
    store.close()
    cfg = TrainConfig.model_validate({
        "name": "skill0", "runs": str(tmp_path), "model": str(tiny_model_dir),
        "store": str(store_path),
        "pipeline": {"steps": 3, "tasks_per_step": 2, "group_size": 4, "eval_every": 0},
        "guard": {"preflight": False},
        "assets": {"curriculum": {"name": "fmt", "start": 1.0, "end": 0.0, "steps": 2}},
    })  # fmt: skip
    train(cfg, agent=short_agent, reward_fn=reward, tasks=(tasks("t", 6), tasks("e", 3, "eval")))
    store = SqliteStore(store_path)
    rollouts = store.rollouts()
    by_step = {s: [r for r in rollouts if f"/step{s}/" in (r.group_id or "")] for s in range(3)}
    assert all(r.assets == {"fmt": 1} for r in by_step[0]) and len(by_step[0]) == 8
    assert all(r.assets == {"fmt": 0} for r in by_step[2]) and len(by_step[2]) == 8
    evals = [r for r in rollouts if r.task_id.startswith("e")]
    assert len(evals) >= 6 and all(r.assets == {"fmt": 0} for r in evals)  # before and after
    for r in rollouts:
        for span in store.spans(r.id):
            carried = r.assets == {"fmt": 1}
            assert span.assets == ({"fmt": 1} if carried else {})
            first = span.messages[0]
            assert (first == {"role": "system", "content": text}) == carried
            # distill (the default): a carried call's prompt without the asset is recorded,
            # shorter by the system turn the asset added
            plain = span.response.get(UNASSISTED)
            assert (plain is not None) == carried
            assert plain is None or len(plain) < len(span.prompt_ids)
    store.close()
    metrics = [json.loads(line) for line in (tmp_path / "skill0" / "metrics.jsonl").open()]
    steps = [m for m in metrics if "assets/carried" in m]
    assert [m["assets/probability"] for m in steps] == pytest.approx([1.0, 0.5, 0.0])
    assert steps[0]["assets/carried"] == 1.0 and steps[2]["assets/carried"] == 0.0
    assert {m["assets/version"] for m in steps} == {1}


def test_a_curriculum_asset_missing_from_the_store_is_refused_at_start(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tracerl.pipeline.config import TrainConfig
    from tracerl.pipeline.run import train

    cfg = TrainConfig.model_validate({
        "name": "nope", "runs": str(tmp_path), "model": str(tiny_model_dir),
        "pipeline": {"steps": 1, "tasks_per_step": 1, "group_size": 2},
        "assets": {"curriculum": {"name": "fmt"}},
    })  # fmt: skip
    with pytest.raises(ValueError, match="no asset 'fmt' in the run's store"):
        train(
            cfg, agent=short_agent, reward_fn=reward, tasks=(tasks("t", 2), tasks("e", 1, "eval"))
        )
