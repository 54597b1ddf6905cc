"""Training two roles together against training one with the other frozen (M-GRPO's question).

The planner-executor example (examples/planner_executor/): a planner splits a multi-step
arithmetic question into sub-questions, an executor answers each with the calculator, the
planner composes the answer. Both roles start from weak tiny models (build_models.py: each
knows its skill but often takes a shortcut). Three runs with the same rollout budget
(steps x tasks_per_step x group_size), the same optimizer and task stream:

- both: planner and executor trained, each its own model, advantages within groups per role;
- planner_only: the planner trained, the executor frozen (served and recorded, not trained);
- executor_only: the executor trained, the planner frozen;
- both_aligned (only with --setups): both trained, with M-GRPO's trajectory alignment of the
  executor (every rollout gives it exactly --align rows; tracerl.algorithms.alignment).

Last line, one JSON object: the final held-out success of each setup run (`both`,
`planner_only`, `executor_only` by default), the success before training, and each run's
wall time.

    .venv/bin/python bench/multiagent.py [--steps 20 --tasks-per-step 16 --group-size 8]
    .venv/bin/python bench/multiagent.py --setups both,both_aligned --align 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tracerl import ensure_passive_omp

ensure_passive_omp()

from tracerl.agents import python_agent  # noqa: E402
from tracerl.algorithms.config import AlgorithmConfig  # noqa: E402
from tracerl.demo import cache_dir, example_module  # noqa: E402
from tracerl.engines.config import EngineConfig  # noqa: E402
from tracerl.pipeline.config import PipelineConfig, TrainConfig  # noqa: E402
from tracerl.pipeline.run import train  # noqa: E402
from tracerl.roles import RoleConfig  # noqa: E402
from tracerl.runner import RunnerConfig  # noqa: E402
from tracerl.trainer.trainer import TrainerConfig  # noqa: E402
from tracerl.types import Task  # noqa: E402

SETUPS = {
    "both": (False, False),
    "planner_only": (False, True),
    "executor_only": (True, False),
    "both_aligned": (False, False),
}
"""Run name -> (planner frozen, executor frozen)."""


def weak_models() -> tuple[str, str]:
    """The example's weak planner and executor, built once into the cache (~7.5 min)."""
    build = example_module("planner_executor", "build_models")
    out = cache_dir() / "models" / build.cache_name(build.BuildConfig())
    if not (out / "build.json").exists():
        build.build_models(out)
    return str(out / "planner"), str(out / "executor")


def run_setup(name: str, args: argparse.Namespace, root: Path) -> dict:
    """Train one setup; returns its summary."""
    if args.models:
        planner, executor = f"{args.models}/planner", f"{args.models}/executor"
    else:
        planner, executor = weak_models()
    frozen_planner, frozen_executor = SETUPS[name]
    tasks = example_module("planner_executor", "tasks")
    agent = example_module("planner_executor", "agent")
    reward = example_module("planner_executor", "reward")
    train_tasks = [Task.model_validate(t) for t in tasks.make_tasks(2000, "train", 0)]
    held_out = [Task.model_validate(t) for t in tasks.make_tasks(args.eval_tasks, "eval", 1)]
    cfg = TrainConfig(
        name=name,
        runs=str(root),
        model=planner,
        model_name="planner",  # what the runner tells the agent; it calls "executor" itself
        roles={
            "planner": RoleConfig(model=planner, frozen=frozen_planner),
            "executor": RoleConfig(model=executor, frozen=frozen_executor),
        },
        eval_before=name == args.setups[0],
        algorithm=AlgorithmConfig(align={"executor": args.align} if name == "both_aligned" else {}),
        pipeline=PipelineConfig(
            steps=args.steps,
            tasks_per_step=args.tasks_per_step,
            group_size=args.group_size,
            eval_every=0,
        ),
        trainer=TrainerConfig(lr=args.lr, minibatches=2, warmup_steps=5, schedule="cosine"),
        runner=RunnerConfig(concurrency=args.concurrency),
        engine=EngineConfig(max_batch_size=64),
    )
    with ThreadPoolExecutor(args.concurrency) as threads:
        summary = train(
            cfg, python_agent(agent.run, threads), reward.reward, (train_tasks, held_out)
        )
    return summary.model_dump()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tasks-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eval-tasks", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--runs", default=None, help="keep the runs here (default: a temp dir)")
    p.add_argument(
        "--models", default=None, help="a dir holding planner/ and executor/ (default: built)"
    )
    p.add_argument(
        "--setups",
        type=lambda v: v.split(","),
        default=["both", "planner_only", "executor_only"],
        help=f"comma-separated, from {','.join(SETUPS)}",
    )
    p.add_argument("--align", type=int, default=2, help="both_aligned: executor rows per rollout")
    args = p.parse_args()
    unknown = sorted(set(args.setups) - set(SETUPS))
    if unknown:
        p.error(f"unknown setups {unknown}; choose from {list(SETUPS)}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.runs or tmp)
        results = {name: run_setup(name, args, root) for name in args.setups}
    for name, r in results.items():
        before = r["success_before"]
        start = f"{before:.3f} -> " if before is not None else ""
        print(f"{name:>14}  held-out success {start}{r['success_after']:.3f}  {r['wall_s']:.0f} s")
    report = {name: r["success_after"] for name, r in results.items()}
    report |= {
        "before": results[args.setups[0]]["success_before"],
        "wall_s": {name: round(r["wall_s"], 1) for name, r in results.items()},
        "rollouts_per_run": args.steps * args.tasks_per_step * args.group_size,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
