"""`tracerl sft`: a supervised warm start from demonstrations, before any RL."""

from __future__ import annotations

from rich.console import Console

from tracerl.entrypoints import quiet_model_loading
from tracerl.entrypoints.config import SftCommand
from tracerl.models.recipe import HabitStage, skill_then_habit
from tracerl.models.sft import SftConfig, SftResult, load_demos, sft_new_or_base


def main(cfg: SftCommand, console: Console) -> None:
    """Fine-tune `base` (or a new tiny model) on the demos and save it to `out`."""
    quiet_model_loading()
    try:
        demos = load_demos(cfg.demos)
    except (OSError, ValueError) as e:
        raise SystemExit(str(e)) from None
    # The flags left unset keep SftConfig's defaults.
    given = cfg.model_dump(include={"steps", "stop_loss", "lr", "seed"}, exclude_none=True)
    if cfg.recipe == "plain":
        _print(console, sft_new_or_base(demos, cfg.out, cfg.base, SftConfig(**given)))
        return
    habit = HabitStage(rate=cfg.habit_rate, steps=cfg.habit_steps, lr=cfg.habit_lr)
    for stage in skill_then_habit(demos, cfg.out, cfg.base, SftConfig(**given), habit):
        _print(console, stage)


def _print(console: Console, result: SftResult) -> None:
    console.print(
        f"saved {result.out_dir}: {result.steps} steps, final loss {result.final_loss:.3f}, "
        f"{result.tokens_per_s:.0f} tok/s"
    )
