"""Tool noise curriculum: does training with perturbed tool results make the calculator
agent hold up when its tools misbehave, and what does it cost on clean tools?

Builds (or reuses) the demo's weak tiny calculator model, writes calculator tasks, then
trains it twice with `train(TrainConfig(...))`, the same config but for the runner's noise:
`clean` (none) and `noisy` (a curriculum, p0 -> p1 over ramp_steps; tracerl/noise.py).
Each exported `model/` (and the start, "before") is then evaluated on the held-out split
as `tracerl eval` does, once with noise off and once with noise at a fixed `--eval-p`
(same noise seed for every model). The in-run evaluations of the noisy run see the
curriculum's noise, so its exported checkpoint is chosen on noisy held-out success.
Prints a 2x2 table, then one JSON line:
{"clean_on_clean", "clean_on_noisy", "noisy_on_clean", "noisy_on_noisy", "before_clean",
 "before_noisy" (held-out success, 0-1), "steps", "wall_s": {phase: seconds}}.
Usage: python bench/noise.py [--steps 20] [--p1 0.3] [--ramp-steps 10] [--eval-p 0.3]
       [--held-out 200] [--runs runs/noise]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from tracerl import ensure_passive_omp

ensure_passive_omp()

from rich.console import Console  # noqa: E402

from tracerl.demo import ensure_calculator_model, write_calculator_tasks  # noqa: E402
from tracerl.entrypoints import eval as eval_command  # noqa: E402
from tracerl.entrypoints.config import EvalCommand  # noqa: E402
from tracerl.evaluate import EvalReport  # noqa: E402
from tracerl.examples import example_file  # noqa: E402
from tracerl.pipeline.config import TrainConfig  # noqa: E402
from tracerl.pipeline.run import train  # noqa: E402

TRAIN_TASKS = 2000
AGENT = f"{example_file('calculator', 'agent')}:run"
REWARD = f"{example_file('calculator', 'reward')}:reward"


def noise(p0: float, p1: float, ramp_steps: int, delay_s: float) -> dict:
    """The runner's noise section (off when p0 and p1 are 0)."""
    return {"p0": p0, "p1": p1, "ramp_steps": ramp_steps, "delay_s": delay_s, "seed": 0}


def train_one(name: str, model: Path, tasks: Path, runs: Path, args: argparse.Namespace,
              runner_noise: dict) -> Path:  # fmt: skip
    """One run with TrainConfig's defaults but steps (and sizes, if given) and noise; its
    exported model dir. The start is evaluated here, not by the run."""
    pipeline: dict = {"steps": args.steps}
    if args.tasks_per_step:
        pipeline["tasks_per_step"] = args.tasks_per_step
    if args.group_size:
        pipeline["group_size"] = args.group_size
    data = {
        "name": name, "runs": str(runs), "model": str(model), "agent": AGENT, "reward": REWARD,
        "tasks": str(tasks), "eval_before": False, "pipeline": pipeline,
        "runner": {"noise": runner_noise},
    }  # fmt: skip
    summary = train(TrainConfig.model_validate(data))
    assert summary.model is not None
    print(f"{name}: exported step {summary.model.model_step}, held-out success "
          f"{summary.success_after:.3f} (last {summary.model.last_success:.3f})", flush=True)  # fmt: skip
    return Path(summary.model.model_dir)


def evaluate_one(
    name: str, model: Path, tasks: Path, runs: Path, p: float, delay_s: float
) -> float:
    """Held-out success of `model` with tool noise at fixed probability `p` (0: clean)."""
    cfg = EvalCommand.model_validate({
        "agent": AGENT, "tasks": str(tasks), "reward": REWARD, "split": "eval",
        "model": str(model), "name": name, "runs": str(runs),
        "runner": {"noise": noise(p, p, 0, delay_s)},
    })  # fmt: skip
    eval_command.main(cfg, Console())
    report = EvalReport.model_validate_json((runs / name / "eval.json").read_text())
    return report.success_rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tasks-per-step", type=int, default=None, help="default: TrainConfig's")
    p.add_argument("--group-size", type=int, default=None, help="default: TrainConfig's")
    p.add_argument("--p0", type=float, default=0.0)
    p.add_argument("--p1", type=float, default=0.3)
    p.add_argument("--ramp-steps", type=int, default=10)
    p.add_argument("--eval-p", type=float, default=0.3)
    p.add_argument("--delay-s", type=float, default=0.2, help="how late a `delay` answers")
    p.add_argument("--held-out", type=int, default=200)
    p.add_argument("--runs", default="runs/noise")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    wall: dict[str, float] = {}
    t0 = time.perf_counter()
    start = ensure_calculator_model()
    tasks = write_calculator_tasks(runs / "tasks.jsonl", TRAIN_TASKS, args.held_out)
    wall["model"] = time.perf_counter() - t0
    models = {"before": start}
    curricula = {"clean": noise(0.0, 0.0, 0, args.delay_s),
                 "noisy": noise(args.p0, args.p1, args.ramp_steps, args.delay_s)}  # fmt: skip
    for name, runner_noise in curricula.items():
        t0 = time.perf_counter()
        models[name] = train_one(name, start, tasks, runs, args, runner_noise)
        wall[f"train_{name}"] = time.perf_counter() - t0
    success: dict[str, float] = {}
    for name, model in models.items():
        for on, prob in (("clean", 0.0), ("noisy", args.eval_p)):
            t0 = time.perf_counter()
            key = f"{name}_on_{on}" if name != "before" else f"before_{on}"
            success[key] = evaluate_one(f"eval-{key}", model, tasks, runs, prob, args.delay_s)
            wall[f"eval_{key}"] = time.perf_counter() - t0
            print(f"{key}: {success[key]:.3f}", flush=True)
    print(f"\nheld-out success ({args.held_out} tasks; noisy eval p={args.eval_p})")
    print(f"{'trained':>10} | {'clean tools':>11} | {'noisy tools':>11}")
    for name in ("before", "clean", "noisy"):
        key = "before_{}" if name == "before" else f"{name}_on_{{}}"
        on_clean, on_noisy = success[key.format("clean")], success[key.format("noisy")]
        print(f"{name:>10} | {on_clean:>11.3f} | {on_noisy:>11.3f}")
    print(
        json.dumps(
            success | {"steps": args.steps, "wall_s": {k: round(v, 1) for k, v in wall.items()}}
        )
    )


if __name__ == "__main__":
    main()
