"""`tracerl eval`: N rollouts of any agent through a gateway serving the given model(s); the
report (success, calls, tokens, token reuse, per role) and every trace are kept."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console

from tracerl.agents import load_agent, load_callable
from tracerl.entrypoints import quiet_model_loading
from tracerl.entrypoints.config import EvalCommand
from tracerl.evaluate import evaluate, load_tasks, print_report
from tracerl.pipeline.run import start_roles_stack
from tracerl.roles import remote_roles
from tracerl.traces import remember_store


def main(cfg: EvalCommand, console: Console) -> None:
    """Serve, run the rollouts, write <runs>/<name>/eval.json and print the report."""
    quiet_model_loading()
    try:
        top, specs = cfg.top_model(), cfg.policies("eval")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    tasks = load_tasks(cfg.tasks, cfg.split)
    reward_fn = load_callable(cfg.reward) if cfg.reward else None
    run_dir = Path(cfg.runs) / cfg.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    store_path = run_dir / "traces.db"
    remote = remote_roles(cfg.roles, cfg.reply_format())
    stack = start_roles_stack(specs, remote, store_path, cfg.engine, gateway=cfg.gateway)
    remember_store(store_path)
    with ThreadPoolExecutor(cfg.runner.concurrency) as threads:
        agent = load_agent(cfg.agent, threads)
        try:
            rep = evaluate(
                stack.store, stack.url, agent, reward_fn, tasks, cfg.repeats, cfg.runner, model=top
            )
        finally:
            stack.close()
    (run_dir / "eval.json").write_text(rep.model_dump_json(indent=2))
    print_report(rep, console)
    console.print(f"traces: {store_path}")
