"""`tracerl sft`: supervised fine-tuning from demonstrations (OpenAI chat or ADP lines) or
from recorded traces (`--from-traces`, the rows' own token ids), before or between RL runs."""

from __future__ import annotations

from rich.console import Console

from tracerl.entrypoints import quiet_model_loading
from tracerl.entrypoints.config import SftCommand
from tracerl.models.recipe import HabitStage, skill_then_habit
from tracerl.models.sft import Demo, EncodedDemo, SftConfig, SftResult, sft_new_or_base


def trace_filter(cfg: SftCommand) -> str:
    """The filter `--from-traces` reads with: the one given, else the successful rollouts."""
    from tracerl.export.filter import successes

    return cfg.filter if cfg.filter is not None else successes(cfg.success_threshold)


def _examples(cfg: SftCommand, console: Console) -> list[Demo | EncodedDemo]:
    """The training examples the flags name (SystemExit saying what is wrong)."""
    if (cfg.demos is None) == (cfg.from_traces is None):
        raise SystemExit("tracerl sft needs exactly one of --demos FILE and --from-traces STORE")
    from tracerl.export import read_rows, rows_as_examples
    from tracerl.export.formats import read_training_file

    try:
        if cfg.demos is not None:
            return read_training_file(cfg.demos)
        assert cfg.from_traces is not None
        rows = read_rows(cfg.from_traces, trace_filter(cfg))
    except (OSError, ValueError) as e:
        raise SystemExit(str(e)) from None
    if not rows:
        raise SystemExit(f"no rows in {cfg.from_traces} pass the filter {trace_filter(cfg)!r}")
    rollouts = len({r.rollout.id for r in rows})
    default = " (the default: successful rollouts only)" if cfg.filter is None else ""
    console.print(
        f"sft: {len(rows)} rows from {rollouts} rollouts pass {trace_filter(cfg)!r}{default}",
        highlight=False,
    )
    return rows_as_examples(rows)


def sft_config(cfg: SftCommand) -> SftConfig:
    """The SftConfig the flags mean (a held-out share only with a target or when given)."""
    scored = cfg.skill_target is not None or "holdout" in cfg.model_fields_set
    return SftConfig(
        steps=cfg.steps, stop_loss=cfg.stop_loss, lr=cfg.lr, seed=cfg.seed,
        batch_size=cfg.batch_size, bf16=cfg.bf16, device=cfg.device, threads=cfg.threads,
        checkpoint_every=cfg.checkpoint_every, target=cfg.skill_target,
        target_metric=cfg.target_metric, holdout=cfg.holdout if scored else 0.0,
        eval_every=cfg.eval_every, cooldown=cfg.cooldown, lora=cfg.lora,
    )  # fmt: skip


def main(cfg: SftCommand, console: Console) -> None:
    """Fine-tune `base` (or a new tiny model) on the examples and save it to `out`."""
    quiet_model_loading()
    examples = _examples(cfg, console)
    encoded = any(isinstance(e, EncodedDemo) for e in examples)
    if encoded and cfg.base is None:
        raise SystemExit("examples given as token ids need --base (the model that made them)")
    say = console.print
    try:
        if cfg.recipe == "plain":
            result = sft_new_or_base(
                examples, cfg.out, cfg.base, sft_config(cfg), resume=cfg.resume, say=say
            )
            _print(console, "sft", result)
            return
        if encoded:
            raise SystemExit("skill-then-habit degrades conversations; token-id examples have none")
        demos = [e for e in examples if isinstance(e, Demo)]
        habit = HabitStage(rate=cfg.habit_rate, steps=cfg.habit_steps, lr=cfg.habit_lr)
        skill_then_habit(
            demos, cfg.out, cfg.base, sft_config(cfg), habit,
            lambda s, r: _print(console, s, r), resume=cfg.resume, say=say,
        )  # fmt: skip
    except ValueError as e:  # e.g. a checkpoint made with other flags
        raise SystemExit(f"tracerl sft: {e}") from None


def _print(console: Console, stage: str, result: SftResult) -> None:
    """Say what the stage did (`sft` keeps the same beside the model as sft.json)."""
    console.print(
        f"{stage}: saved {result.out_dir}: {result.steps} steps, final loss "
        f"{result.final_loss:.3f}, {result.tokens_per_s:.0f} tok/s, {result.precision}",
        highlight=False,
    )
    if result.held_out:
        scores = ", ".join(f"{c.exact_match:.3f} at {c.step}" for c in result.held_out)
        console.print(f"{stage}: held-out exact match {scores}", highlight=False)
    if result.target_reached:
        console.print(
            f"{stage}: reached the target {result.target:g} ({result.target_metric} match) "
            f"in {result.steps} steps",
            highlight=False,
        )
    elif result.target_reached is False:
        key = "exact_match" if result.target_metric == "exact" else "sampled_match"
        best = max(getattr(c, key) or 0.0 for c in result.held_out)
        then = "; going on to the habit stage" if stage == "skill" else ""
        console.print(
            f"[yellow]warning: {stage}: the {result.steps}-step cap came before the held-out "
            f"target {result.target:g} (best {result.target_metric} match {best:.3f}){then}"
            "[/yellow]",
            highlight=False,
        )
