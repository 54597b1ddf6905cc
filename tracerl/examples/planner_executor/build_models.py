"""Builds the two weak starting models: shared tokenizer and tiny base, then SFT per role.

Both roles' demonstrations (expert.py) train one byte-level BPE tokenizer and size one
random-init tiny Llama, so the planner and the executor speak the same tokens. Then:

1. skill: the executor learns the calculator loop from clean demonstrations; the planner
   starts from that executor (which already copies digits, as the planner must) and learns
   to plan from clean planner demonstrations. 1,000 steps each: the two together solve
   ~46% of held-out questions at temperature 1 (the executor answers ~78% of its
   sub-questions right, and most questions need two).
2. habit: a short low-learning-rate SFT on a mixture where a share of the demos take a
   wrong but consistent shortcut (the executor answers with the expression unevaluated;
   the planner answers with the question's arithmetic unevaluated, or right after its first
   sub-question). Each role now often skips work it knows how to do: ~12% end to end. Each
   role's shortcut caps the system on its own, so training one role alone cannot undo
   the other's.

Usage: python examples/planner_executor/build_models.py OUT_DIR [--planner-skill-steps N] ...
Writes OUT_DIR/{base, executor-skill, planner-skill, planner, executor} (HF model dirs)
and OUT_DIR/build.json (losses and seconds per stage).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from tracerl.examples import example_module
from tracerl.models.sft import Demo, SftConfig, sft
from tracerl.models.template import render_chat
from tracerl.models.tiny import TinyModelConfig, build_tiny_model

ROLES = ("planner", "executor")


class BuildConfig(BaseModel):
    """How the weak models are built; the defaults are the calibrated weak start."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    demos: int = 3000
    """Demonstrations per role and stage."""
    executor_skill_steps: int = 1000
    """SFT steps of the executor on clean demos (batch 16, lr `lr`)."""
    planner_skill_steps: int = 1000
    """SFT steps of the planner on clean demos, starting from the skilled executor."""
    habit_steps: int = 150
    """SFT steps of each role on its shortcut mixture (0: no habit stage)."""
    habit_lr: float = 2e-4
    """Peak learning rate of the habit stage (low: it must not erode the skill)."""
    planner_shortcuts: float = 0.35
    """Share of the planner's habit demos that take a shortcut."""
    planner_mistakes: tuple[str, ...] = ("echo", "skip")
    """The planner's shortcuts, drawn uniformly (see expert.PLANNER_MISTAKES)."""
    executor_shortcuts: float = 0.3
    """Share of the executor's habit demos that take a shortcut."""
    executor_mistakes: tuple[str, ...] = ("echo",)
    """The executor's shortcuts (see expert.EXECUTOR_MISTAKES)."""
    lr: float = 2e-3
    """Peak learning rate of the skill stage."""
    seed: int = 0
    """Seed of the base weights and the data order; demos use seed + 1000 and + 2000."""
    progress: bool = True
    """Show SFT progress bars."""


def cache_name(cfg: BuildConfig) -> str:
    """A folder name that changes whenever the recipe does (for caching built models)."""
    skill = f"skill{cfg.executor_skill_steps}e{cfg.planner_skill_steps}p"
    lazy = f"lazy{cfg.executor_shortcuts}e{cfg.planner_shortcuts}p"
    habit = f"-{lazy}x{cfg.habit_steps}at{cfg.habit_lr}" if cfg.habit_steps else ""
    return f"planner-executor-{skill}{habit}-n{cfg.demos}-lr{cfg.lr}-seed{cfg.seed}"


class BuildResult(BaseModel):
    """Where the models are and what building them cost."""

    planner: str
    """HF model dir of the weak planner."""
    executor: str
    """HF model dir of the weak executor."""
    final_loss: dict[str, float]
    """Mean SFT loss of the last steps of each stage."""
    seconds: dict[str, float]
    """Wall time of each stage, and the total."""
    config: BuildConfig
    """The configuration used."""


def role_demos(role: str, cfg: BuildConfig, shortcuts: bool) -> list[Demo]:
    """The role's demonstrations: clean, or with its shortcut mixture (other tasks)."""
    expert = example_module("planner_executor", "expert")
    if not shortcuts:
        raw = expert.demonstrations(cfg.demos, role, cfg.seed + 1000, noise=0.0)
    elif role == "planner":
        raw = expert.demonstrations(
            cfg.demos, role, cfg.seed + 2000, cfg.planner_shortcuts, cfg.planner_mistakes
        )
    else:
        raw = expert.demonstrations(
            cfg.demos, role, cfg.seed + 2000, cfg.executor_shortcuts, cfg.executor_mistakes
        )
    return [Demo.model_validate(d) for d in raw]


def build_models(out_dir: str | Path, cfg: BuildConfig | None = None) -> BuildResult:
    """Build every stage under out_dir (existing dirs are overwritten)."""
    cfg = cfg or BuildConfig()
    out = Path(out_dir)
    started = time.perf_counter()
    clean = {role: role_demos(role, cfg, shortcuts=False) for role in ROLES}
    texts = [render_chat(d.messages, d.tools) for demos in clean.values() for d in demos]
    build_tiny_model(out / "base", texts, TinyModelConfig(seed=cfg.seed))
    seconds = {"base": time.perf_counter() - started}
    losses: dict[str, float] = {}

    def stage(name: str, start: str, demos: list[Demo], steps: int, lr: float) -> None:
        t0 = time.perf_counter()
        sft_cfg = SftConfig(steps=steps, lr=lr, seed=cfg.seed, progress=cfg.progress)
        result = sft(out / start, demos, out / name, sft_cfg)
        seconds[name], losses[name] = time.perf_counter() - t0, result.final_loss

    stage("executor-skill", "base", clean["executor"], cfg.executor_skill_steps, cfg.lr)
    stage("planner-skill", "executor-skill", clean["planner"], cfg.planner_skill_steps, cfg.lr)
    for role in ROLES:
        if cfg.habit_steps == 0:  # the skilled models are the starting models
            shutil.copytree(out / f"{role}-skill", out / role, dirs_exist_ok=True)
            continue
        demos = role_demos(role, cfg, shortcuts=True)
        stage(role, f"{role}-skill", demos, cfg.habit_steps, cfg.habit_lr)
    seconds["total"] = time.perf_counter() - started
    built = BuildResult(
        planner=str(out / "planner"),
        executor=str(out / "executor"),
        final_loss=losses,
        seconds=seconds,
        config=cfg,
    )
    (out / "build.json").write_text(built.model_dump_json(indent=2))
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    defaults = BuildConfig()
    for name, value in defaults.model_dump().items():
        flag, doc = f"--{name.replace('_', '-')}", BuildConfig.model_fields[name].description
        if isinstance(value, bool):
            action = argparse.BooleanOptionalAction
            parser.add_argument(flag, action=action, default=value, help=doc)
        elif isinstance(value, int | float):
            parser.add_argument(flag, type=type(value), default=value, help=doc)
    args = vars(parser.parse_args())
    out_dir = args.pop("out_dir")
    built = build_models(out_dir, BuildConfig(**args))
    loss = ", ".join(f"{k} {v:.3f}" for k, v in built.final_loss.items())
    print(f"built {built.planner} and {built.executor} in {built.seconds['total']:.0f} s")
    print(f"final SFT loss: {loss}")


if __name__ == "__main__":
    main()
