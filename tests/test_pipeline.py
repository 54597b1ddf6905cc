"""Pure pieces of the pipeline: task order, checkpoints, the CLI's config merge, the demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracerl.entrypoints.train import merge as _merge
from tracerl.pipeline.checkpoints import Checkpoints, PipelineState, read_ledger
from tracerl.pipeline.sources import SourceState, TaskOrder
from tracerl.trainer.config import TrainerConfig
from tracerl.trainer.trainer import Trainer
from tracerl.types import Task

ROOT = Path(__file__).resolve().parents[1]


def test_task_order_is_a_function_of_step_and_covers_each_epoch() -> None:
    tasks = [Task(id=str(i), input={}) for i in range(10)]
    order = TaskOrder(tasks, per_step=5, seed=3)
    epoch = [t.id for t in order.at(0) + order.at(1)]
    assert sorted(epoch) == sorted(t.id for t in tasks)  # one epoch = every task once
    assert [t.id for t in order.at(1)] == [t.id for t in TaskOrder(tasks, 5, 3).at(1)]
    assert [t.id for t in order.at(2)] != [t.id for t in order.at(0)]  # reshuffled


def test_checkpoint_round_trip_and_pruning(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(tiny_model_dir, TrainerConfig())
    ckpts = Checkpoints(tmp_path, keep=2)
    assert ckpts.latest() is None
    for step in (1, 2, 3):
        trainer.version = step
        ckpts.record(step, [f"r{step}"])
        state = PipelineState(step=step, rollouts_trained=step, source=SourceState(issued=step))
        ckpts.save(trainer, state)
    ckpts.record(4, ["r4"])  # trained at step 4, then the process died before its checkpoint
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-2", "step-3"]
    fresh = Trainer(tiny_model_dir, TrainerConfig())
    state = ckpts.restore(fresh)
    assert (state.step, state.rollouts_trained, fresh.version) == (3, 3, 3)
    assert state.source == SourceState(issued=3)
    # The ledger is the history of the restored weights: step 4's update died with it.
    assert read_ledger(tmp_path) == ["r1", "r2", "r3"]


def test_checkpoint_size_does_not_grow_with_the_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Regression: every rollout id ever trained was written into every checkpoint."""
    trainer = Trainer(tiny_model_dir, TrainerConfig())
    ckpts = Checkpoints(tmp_path, keep=1)
    sizes = []
    for step in range(1, 6):
        ckpts.record(step, [f"rollout-{step}-{i:04d}" for i in range(500)])
        ckpts.save(trainer, PipelineState(step=step, rollouts_trained=500 * step))
        sizes.append((tmp_path / "checkpoints" / f"step-{step}" / "pipeline.json").stat().st_size)
    assert max(sizes) - min(sizes) <= 2  # only the numbers' digits change
    assert len(read_ledger(tmp_path)) == 2500


def test_cli_overrides_merge_into_file_config() -> None:
    base = {"pipeline": {"steps": 10, "group_size": 4}, "name": "x"}
    merged = _merge(base, {"pipeline": {"group_size": 8}})
    assert merged == {"pipeline": {"steps": 10, "group_size": 8}, "name": "x"}


def test_train_cli_rejects_missing_fields(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tracerl.cli", "train", "--name", "x"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "train needs --model" in out.stderr


@pytest.mark.slow
def test_demo_runs_end_to_end(calculator_model_dir: Path, tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "tracerl.cli", "demo", "--runs", str(tmp_path),
        "--eval_tasks", "16", "--train_tasks", "32", "--pipeline.steps", "2",
        "--pipeline.tasks_per_step", "4", "--pipeline.group_size", "4", "--pipeline.eval_every", "1",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=os.environ.copy())
    assert out.returncode == 0, out.stderr[-2000:]
    run = tmp_path / "demo"
    summary = json.loads((run / "summary.json").read_text())
    assert {"success_before", "success_after", "wall_s"} <= summary.keys()
    for name in ("config.json", "metrics.jsonl", "reward.png", "traces.db"):
        assert (run / name).exists(), name
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert (run / "model" / "config.json").exists()
    assert "held-out success" in out.stdout
