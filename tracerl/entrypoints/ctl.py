"""`tracerl ctl RUN_DIR pause|resume|checkpoint|stop|set k=v|status`: send a live control
command to a training run and print the loop's answer (tracerl.pipeline.control_files)."""

from __future__ import annotations

from rich.console import Console

from tracerl.dashboard.config import CtlCommand
from tracerl.pipeline.control_files import (
    Applied,
    is_live,
    parse_setting,
    read_state,
    send,
    wait_applied,
)


def _answer(applied: Applied | None, console: Console) -> None:
    if applied is None:
        console.print("sent; not applied yet (applied between steps)")
    elif applied.ok:
        what = f" {applied.key}={applied.value}" if applied.key else ""
        console.print(f"applied{what}: takes effect at step {applied.step}")
    else:
        raise SystemExit(f"refused: {applied.error}")


def main(cfg: CtlCommand, console: Console) -> None:
    """Send the command(s), then wait for a live run's answer (SystemExit on a refusal)."""
    if cfg.action == "status":
        state = read_state(cfg.run_dir)
        console.print(state.model_dump_json(indent=2) if state else "no training loop yet")
        return
    try:
        if cfg.action == "set":
            if not cfg.settings:
                raise ValueError("set needs key=value (e.g. trainer.lr=3e-4)")
            sent = [send(cfg.run_dir, "set", *parse_setting(s)) for s in cfg.settings]
        elif cfg.settings:
            raise ValueError(f"{cfg.action} takes no key=value")
        else:
            sent = [send(cfg.run_dir, cfg.action)]
    except ValueError as e:
        raise SystemExit(f"tracerl ctl: {e}") from None
    if not is_live(read_state(cfg.run_dir)):
        console.print("the run is not training now: applied when it resumes")
        return
    for cmd in sent:
        _answer(wait_applied(cfg.run_dir, cmd.id, cfg.wait), console)
