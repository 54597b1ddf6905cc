"""Measures the planner-executor agent end to end with both models served by one gateway.

Starts a store and a gateway answering to "planner" and "executor" (one HF engine per model
dir), runs N held-out tasks through tracerl's runner with agent.py unchanged, and prints
the success rate with what the traces say about each role: calls per rollout, executor
sub-agents per rollout, and how often an executor's answer is right for the question it
was asked.
Usage: python examples/planner_executor/eval_local.py MODELS_DIR [--tasks 200] [--repeats 1]
(MODELS_DIR holds planner/ and executor/, as build_models.py writes them.)
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tracerl.agents import load_callable, python_agent
from tracerl.evaluate import EvalReport, evaluate
from tracerl.examples import example_file, example_module
from tracerl.runner import RunnerConfig
from tracerl.stack import start_multi_stack
from tracerl.store.sqlite import SqliteStore
from tracerl.types import Rollout, Span, Task

ROLES = ("planner", "executor")


def _last_int(text: str) -> str | None:
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


def executor_accuracy(spans: list[Span]) -> float:
    """Share of executor conversations whose final answer is right for their question."""
    agent = example_module("planner_executor", "agent")
    expert = example_module("planner_executor", "expert")
    finals = [s for s in spans if s.role == "executor" and s.finish_reason != "tool_calls"]
    right = 0
    for span in finals:
        question = str(span.messages[1].get("content", "")) if len(span.messages) > 1 else ""
        truth = agent.calculate(expert.expression(question))
        message = span.response.get("message")
        content = str(message.get("content") or "") if isinstance(message, dict) else ""
        right += _last_int(content) == truth
    return right / max(len(finals), 1)


def role_stats(store: SqliteStore, rollouts: list[Rollout]) -> dict[str, object]:
    """Per-role numbers read from the traces."""
    spans = [s for r in rollouts for s in store.spans(r.id, r.attempt)]
    n = max(len(rollouts), 1)
    subagents: Counter[int] = Counter()
    for r in rollouts:
        parents = {s.parent_span_id for s in store.spans(r.id, r.attempt) if s.role == "executor"}
        subagents[len(parents)] += 1
    return {
        "calls_per_rollout": {role: sum(s.role == role for s in spans) / n for role in ROLES},
        "executor_subagents_per_rollout": dict(sorted(subagents.items())),
        "executor_accuracy": round(executor_accuracy(spans), 3),
    }


def run_eval(
    model_dirs: dict[str, Path],
    n_tasks: int = 200,
    repeats: int = 1,
    split: str = "eval",
    concurrency: int = 32,
    store_path: str | Path | None = None,
) -> tuple[EvalReport, dict[str, object]]:
    """Serve the role -> model dir map, run n_tasks x repeats rollouts; report and role stats."""
    tasks_mod = example_module("planner_executor", "tasks")
    seed = 0 if split == "train" else 1
    tasks = [Task.model_validate(t) for t in tasks_mod.make_tasks(n_tasks, split, seed)]
    reward_fn = load_callable(f"{example_file('planner_executor', 'reward')}:reward")
    run = load_callable(f"{example_file('planner_executor', 'agent')}:run")
    with tempfile.TemporaryDirectory() as tmp:
        path = store_path or Path(tmp) / "traces.db"
        stack = start_multi_stack(model_dirs, {role: role for role in model_dirs}, path)
        cfg = RunnerConfig(concurrency=concurrency)
        try:
            with ThreadPoolExecutor(concurrency) as threads:
                agent = python_agent(run, threads)
                rep = evaluate(
                    stack.store, stack.url, agent, reward_fn, tasks, repeats, cfg, model="planner"
                )
            stats = role_stats(stack.store, stack.store.rollouts(group_id=rep.group_id))
        finally:
            stack.close()
    return rep, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models_dir")
    for role in ROLES:
        parser.add_argument(
            f"--{role}", default=None, help=f"{role} model dir (default: in MODELS_DIR)"
        )
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--split", default="eval")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--store", default=None, help="keep the traces in this SQLite file")
    args = parser.parse_args()
    dirs = {role: Path(getattr(args, role) or Path(args.models_dir) / role) for role in ROLES}
    rep, stats = run_eval(dirs, args.tasks, args.repeats, args.split, args.concurrency, args.store)
    print(
        f"success {rep.success_rate:.1%} over {rep.rollouts} rollouts · "
        f"{rep.mean_calls:.2f} calls/rollout · {rep.wall_s:.1f} s"
    )
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
