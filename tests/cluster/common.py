"""The short calculator run the cluster tests train: the demo's weak model, a few steps."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tracerl.demo import write_calculator_tasks
from tracerl.examples import example_file
from tracerl.pipeline.config import TrainConfig

MODEL = "calculator-tiny-skill1000-lazy0.65x150at0.0002-n4000-seed0"


def calculator_config(runs: Path, name: str, **over: Any) -> TrainConfig:
    """4 steps of 8 tasks x 4 rollouts on the cached demo model, 64 held-out tasks."""
    model = Path(os.environ["TRACERL_HOME"]) / "models" / MODEL
    if not (model / "config.json").exists():
        raise SystemExit(f"the demo model is not built: {model} (tests build it, `make demo` too)")
    tasks = write_calculator_tasks(runs / name / "tasks.jsonl", 400, 64)
    data: dict[str, Any] = {
        "name": name,
        "runs": str(runs),
        "model": str(model),
        "agent": f"{example_file('calculator', 'agent')}:run",
        "reward": f"{example_file('calculator', 'reward')}:reward",
        "tasks": str(tasks),
        "pipeline": {"steps": 4, "tasks_per_step": 8, "group_size": 4, "eval_every": 0},
        "trainer": {"lr": 1e-3, "minibatches": 1},
        "runner": {"concurrency": 8},
        "engine": {"max_batch_size": 32},
    }
    for key, value in over.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return TrainConfig.model_validate(data)
