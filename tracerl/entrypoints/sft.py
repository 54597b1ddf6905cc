"""`tracerl sft`: supervised fine-tuning from demonstrations (OpenAI chat or ADP lines) or
from recorded traces (`--from-traces`, the rows' own token ids), before or between RL runs."""

from __future__ import annotations

from rich.console import Console

from tracerl.entrypoints import quiet_model_loading
from tracerl.entrypoints.config import SftCommand
from tracerl.models.recipe import HabitStage, skill_then_habit
from tracerl.models.sft import Demo, EncodedDemo, SftConfig, SftResult, sft_new_or_base


def _examples(cfg: SftCommand) -> list[Demo | EncodedDemo]:
    """The training examples the flags name (SystemExit saying what is wrong)."""
    if (cfg.demos is None) == (cfg.from_traces is None):
        raise SystemExit("tracerl sft needs exactly one of --demos FILE and --from-traces STORE")
    from tracerl.export import read_rows, rows_as_examples
    from tracerl.export.formats import read_training_file

    try:
        if cfg.demos is not None:
            return read_training_file(cfg.demos)
        assert cfg.from_traces is not None
        rows = read_rows(cfg.from_traces, cfg.filter)
    except (OSError, ValueError) as e:
        raise SystemExit(str(e)) from None
    if not rows:
        raise SystemExit(f"no rows in {cfg.from_traces} pass the filter {cfg.filter!r}")
    return rows_as_examples(rows)


def main(cfg: SftCommand, console: Console) -> None:
    """Fine-tune `base` (or a new tiny model) on the examples and save it to `out`."""
    quiet_model_loading()
    examples = _examples(cfg)
    # The flags left unset keep SftConfig's defaults.
    given = cfg.model_dump(include={"steps", "stop_loss", "lr", "seed"}, exclude_none=True)
    if cfg.skill_target is not None or cfg.holdout is not None:
        holdout = 0.1 if cfg.holdout is None else cfg.holdout
        given |= {"target": cfg.skill_target, "holdout": holdout, "eval_every": cfg.eval_every}
    encoded = any(isinstance(e, EncodedDemo) for e in examples)
    if encoded and cfg.base is None:
        raise SystemExit("examples given as token ids need --base (the model that made them)")
    if cfg.recipe == "plain":
        _print(console, "sft", sft_new_or_base(examples, cfg.out, cfg.base, SftConfig(**given)))
        return
    if encoded:
        raise SystemExit("skill-then-habit degrades conversations; token-id examples have none")
    demos = [e for e in examples if isinstance(e, Demo)]
    habit = HabitStage(rate=cfg.habit_rate, steps=cfg.habit_steps, lr=cfg.habit_lr)
    skill_then_habit(
        demos, cfg.out, cfg.base, SftConfig(**given), habit, lambda s, r: _print(console, s, r)
    )


def _print(console: Console, stage: str, result: SftResult) -> None:
    """Say what the stage did (`sft` keeps the same beside the model as sft.json)."""
    console.print(
        f"{stage}: saved {result.out_dir}: {result.steps} steps, final loss "
        f"{result.final_loss:.3f}, {result.tokens_per_s:.0f} tok/s"
    )
    if result.held_out:
        scores = ", ".join(f"{c.exact_match:.3f} at {c.step}" for c in result.held_out)
        console.print(f"{stage}: held-out exact match {scores}")
    if result.target_reached:
        console.print(f"{stage}: reached the target {result.target:g} in {result.steps} steps")
    elif result.target_reached is False:
        best = max(c.exact_match for c in result.held_out)
        then = "; going on to the habit stage" if stage == "skill" else ""
        console.print(
            f"[yellow]warning: {stage}: the {result.steps}-step cap came before the held-out "
            f"target {result.target:g} (best exact match {best:.3f}){then}[/yellow]",
            highlight=False,
        )
