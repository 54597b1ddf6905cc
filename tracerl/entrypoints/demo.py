"""`tracerl demo`: the calculator agent trained from its traces, before -> after, on a laptop."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from tracerl.demo import DemoConfig, demo_run_config, start_report
from tracerl.entrypoints import quiet_model_loading
from tracerl.pipeline.run import train
from tracerl.traces import remember_store


def main(cfg: DemoConfig, console: Console) -> None:
    """Build (or reuse) the model, train, and print held-out success before -> after."""
    quiet_model_loading()
    started = time.perf_counter()
    console.print(f"[bold]tracerl demo[/bold]: calculator agent, tiny model, {cfg.device}")
    run_cfg = demo_run_config(cfg)
    console.print(f"model: {run_cfg.model} (ready in {time.perf_counter() - started:.0f} s)")
    if not cfg.model:  # the demo's own start: say what its build measured, before training
        for line in start_report(cfg.recipe):
            console.print(line, highlight=False)
    remember_store(Path(run_cfg.runs) / run_cfg.name / "traces.db")
    summary = train(run_cfg)
    wall = time.perf_counter() - started
    before = summary.success_before or 0.0
    console.print(
        f"[bold green]held-out success {before:.1%} -> {summary.success_after:.1%}[/bold green]"
        f" in {wall / 60:.1f} min ({summary.steps} steps, {summary.rollouts_trained} "
        f"rollouts trained) · outputs: {summary.run_dir}/ (reward.png, pipeline.png, "
        "metrics.jsonl, tb/, model/, summary.json, traces.db)"
    )
