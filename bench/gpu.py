"""The same run on a GPU and on the CPU: only `device` changes.

For each device in --devices (default: cuda, then cpu):

1. serve: the demo's weak calculator model on the hf engine, the calculator agent (plain
   openai client) on --tasks held-out tasks through the gateway; rollouts/s, and the largest
   difference between recorded log-probs and a re-score of each span on the same device;
2. train: `tracerl.train.train` with the calculator agent for --steps steps of 16 tasks x 8
   rollouts (trainer and engine on the device); median seconds per step and trainer
   tokens/s, held-out success before and after, and the policy versions the spans carry.

Last line, one JSON object keyed by device, plus `serve_speedup` and `step_speedup` (the
CPU's time over the first device's) when both ran. Without CUDA, a cuda device is skipped.

    .venv/bin/python bench/gpu.py [--devices cuda,cpu --steps 5 --model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tracerl import ensure_passive_omp

ensure_passive_omp()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from tracerl.agents import python_agent  # noqa: E402
from tracerl.demo import ensure_calculator_model, example_module  # noqa: E402
from tracerl.engines.config import EngineConfig  # noqa: E402
from tracerl.engines.scoring import score_completion  # noqa: E402
from tracerl.evaluate import run_rollouts  # noqa: E402
from tracerl.pipeline.config import PipelineConfig, TrainConfig  # noqa: E402
from tracerl.pipeline.run import train  # noqa: E402
from tracerl.runner import RunnerConfig  # noqa: E402
from tracerl.stack import start_stack  # noqa: E402
from tracerl.store.sqlite import SqliteStore  # noqa: E402
from tracerl.trainer.trainer import TrainerConfig  # noqa: E402
from tracerl.types import Task  # noqa: E402


def tasks(n: int, split: str, seed: int) -> list[Task]:
    return [
        Task.model_validate(t)
        for t in example_module("calculator", "tasks").make_tasks(n, split, seed)
    ]


def serve(model: str, device: str, n: int, root: Path) -> dict:
    """Rollouts through the gateway on `device`; rollouts/s and the log-prob re-score gap."""
    agent = example_module("calculator", "agent")
    reward = example_module("calculator", "reward")
    stack = start_stack(
        model, root / f"serve-{device}.db", EngineConfig(device=device, max_batch_size=64)
    )
    try:
        with ThreadPoolExecutor(64) as threads:
            started = time.perf_counter()
            rollouts = run_rollouts(
                stack.store, stack.url, python_agent(agent.run, threads), reward.reward,
                tasks(n, "eval", 1), cfg=RunnerConfig(concurrency=64),
            )  # fmt: skip
            wall = time.perf_counter() - started
        spans = [s for r in rollouts for s in stack.store.spans(r.id)]
    finally:
        stack.close()
    scorer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    worst = 0.0
    for s in spans:
        rescored = score_completion(scorer, s.prompt_ids, s.completion_ids, s.temperature)
        worst = max([worst, *(abs(a - b) for a, b in zip(rescored, s.logprobs, strict=True))])
    return {
        "rollouts_per_s": round(len(rollouts) / wall, 2),
        "serve_s": round(wall, 2),
        "completion_tokens": sum(len(s.completion_ids) for s in spans),
        "success": round(sum((r.reward or 0) >= 1 for r in rollouts) / len(rollouts), 3),
        "logprob_max_diff": float(f"{worst:.3g}"),
    }


def train_on(model: str, device: str, steps: int, eval_tasks: int, root: Path) -> dict:
    """A short RL run with trainer and engine on `device`."""
    agent = example_module("calculator", "agent")
    reward = example_module("calculator", "reward")
    cfg = TrainConfig(
        name=f"train-{device.replace(':', '')}",
        runs=str(root),
        model=model,
        device=device,
        pipeline=PipelineConfig(steps=steps, tasks_per_step=16, group_size=8, eval_every=0),
        trainer=TrainerConfig(lr=3e-4, minibatches=2, warmup_steps=2),
        runner=RunnerConfig(concurrency=64),
        engine=EngineConfig(max_batch_size=64),
    )
    with ThreadPoolExecutor(64) as threads:
        summary = train(
            cfg, python_agent(agent.run, threads), reward.reward,
            (tasks(2000, "train", 0), tasks(eval_tasks, "eval", 1)),
        )  # fmt: skip
    run = Path(summary.run_dir)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps_m = [m for m in lines if "time/train_s" in m]
    store = SqliteStore(run / "traces.db")
    versions = sorted({s.policy_version for r in store.rollouts() for s in store.spans(r.id)})
    store.close()

    def median(key: str) -> float:
        # The median, not the mean: a device's first steps pay its warm-up (CUDA kernels).
        return statistics.median(m[key] for m in steps_m)

    return {
        "step_s": round(median("time/generate_s") + median("time/train_s"), 2),
        "train_s_per_step": round(median("time/train_s"), 3),
        "generate_s_per_step": round(median("time/generate_s"), 3),
        "train_tok_per_s": round(median("train/tokens_per_s")),
        "success_before": summary.success_before,
        "success_after": summary.success_after,
        "span_versions": versions,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=lambda v: v.split(","), default=["cuda", "cpu"])
    p.add_argument("--model", default=None, help="a local HF model dir (default: the demo's)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tasks", type=int, default=128, help="held-out rollouts served per device")
    p.add_argument("--eval-tasks", type=int, default=100)
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = args.model or str(ensure_calculator_model())
    report: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for device in args.devices:
            if device.startswith("cuda") and not torch.cuda.is_available():
                report[device] = "skipped: no CUDA device"
                continue
            name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
            result = {"name": name} | serve(model, device, args.tasks, Path(tmp))
            result |= train_on(model, device, args.steps, args.eval_tasks, Path(tmp))
            report[device] = result
            print(device, json.dumps(result))
    ran = [d for d in args.devices if isinstance(report.get(d), dict)]
    if len(ran) == 2:
        first, second = (report[d] for d in ran)
        assert isinstance(first, dict) and isinstance(second, dict)
        report["serve_speedup"] = round(second["serve_s"] / first["serve_s"], 2)
        report["step_speedup"] = round(second["step_s"] / first["step_s"], 2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
