"""The calculator demo: its config (TrainConfig with the demo's defaults), its tasks, and its
warm-started tiny model.

The model is built once and cached: expert demonstrations from the example's own code,
a tokenizer and a random-init tiny Llama trained on their text, then a supervised warm start
in two stages that leaves the agent weak (roughly 30-38% success) so RL has room to work;
see CalculatorRecipe for why two stages. The demo is then an ordinary training run: its
resolved config names the model, a task file and the shipped example, so `tracerl train
--resume runs/demo` continues it. Torch loads only where a model is built, so that reading
DemoConfig (`tracerl demo --help`) stays light.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from tracerl.cache import build_lock, cache_dir
from tracerl.engines.config import EngineConfig
from tracerl.examples import example_dir, example_file, example_module
from tracerl.pipeline.config import PipelineConfig, TrainConfig
from tracerl.precision import Bf16Setting
from tracerl.runner import RunnerConfig

if TYPE_CHECKING:
    from tracerl.models.sft import Demo

__all__ = [
    "CalculatorRecipe",
    "DemoConfig",
    "cache_dir",
    "calculator_demos",
    "demo_run_config",
    "ensure_calculator_model",
    "start_report",
    "example_dir",
    "example_module",
    "write_calculator_tasks",
]


class CalculatorRecipe(BaseModel):
    """How the demo's weak calculator model is made: first the skill, then a habit to unlearn.

    A model that is weak because it is undertrained (early-stopped SFT) is a poor RL start:
    learning to copy digits is a sudden transition whose step varies with the data order, so
    the warm start is erratic (3-80% success), and RL has to teach the copy skill itself,
    slowly. Instead the model first learns the whole task from clean demonstrations, then a
    short second SFT on demonstrations where a lazy expert often answers with the
    unevaluated expression instead of calling the calculator. The result knows how to use
    the tool but mostly does not (~25-38% success at temperature 1): the situation of an
    agent whose model under-uses its tools, and the one RL fixes from rewards alone.

    The skill stage sets RL's ceiling (RL teaches the habit, not the copying), and when the
    copy skill appears depends on the seed and on the CPU's arithmetic: in fp32 on an AVX2
    CPU, seed 1's held-out exact match was 0.33 at step 400 and 0.99 at 1,500, seed 0's
    0.93 at 400. So the stage trains until the skill is measured, never for a fixed count:
    10% of its demos are held out and every 50 steps scored by their sampled match, the
    probability that sampling at temperature 1 (as the agent does) copies a demo whole; it
    stops at `skill_target`, `skill_cap` being only a safety limit, and the learning rate is
    constant until then (tracerl.models.sft).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    demos: int = Field(default=4000, ge=1)
    """Expert demonstrations per stage."""
    skill_target: float = Field(default=0.9, gt=0, le=1)
    """Held-out sampled match (the probability that a temperature-1 sample copies a clean
    demo whole) at which the skill stage stops (batch 16)."""
    skill_lr: float = Field(default=1e-3, gt=0)
    """The skill stage's constant learning rate. At 2e-3, in fp32 on an AVX2 CPU, seed 1 still
    copied 0.16 of the held-out demos after 3,000 steps; at 1e-3 seeds 0, 1 and 2 passed a
    sampled match of 0.94 within 600, 700 and 400 steps."""
    skill_cap: int = Field(default=3000, ge=1)
    """Most skill steps: a safety limit (the demo says before training when it came first)."""
    skill_cooldown: int = Field(default=200, ge=0)
    """Steps after the target with the rate decaying to zero: at a constant rate the held-out
    score wanders (seed 0, fp32, 2e-3: 0.91 at step 600, 0.98 at 1,100, 0.57 at 1,600), a
    decay settles it."""
    lazy_rate: float = Field(default=0.65, ge=0.0, le=1.0)
    """Share of stage-two demonstrations that answer without the calculator."""
    habit_steps: int = Field(default=150, ge=0)
    """SFT steps on the lazy mixture."""
    habit_lr: float = 2e-4
    """Peak learning rate of stage two; at 1e-3 it also erodes the copy skill."""
    seed: int = 0
    """Seed of the model, the demonstrations and their order."""
    heads: int = Field(default=4, ge=1)
    """Attention heads of the 192-wide model: 4 (head size 48) is the measured default; 3
    (head size 64) is a size vLLM's CPU attention accepts (`--engine.kind vllm`)."""
    bf16: Bf16Setting = "auto"
    """The stages' precision (tracerl.precision): auto, or true/false to build the start in
    bf16 or fp32 whatever the hardware; a forced one is a start of its own in the cache."""

    def name(self) -> str:
        """The cache directory name: one per distinct recipe."""
        return (
            f"calculator-tiny{self._shape()}-{self._skill()}-lazy{self.lazy_rate:g}x"
            f"{self.habit_steps}at{self.habit_lr:g}-n{self.demos}-seed{self.seed}{self._arith()}"
        )

    def skill_name(self) -> str:
        """The cache directory name of the skill stage."""
        return (
            f"calculator-tiny{self._shape()}-{self._skill()}-n{self.demos}-seed{self.seed}"
            f"{self._arith()}"
        )

    def _arith(self) -> str:
        """ "" under auto, else -bf16 or -fp32."""
        return "" if self.bf16 == "auto" else ("-bf16" if self.bf16 else "-fp32")

    def _skill(self) -> str:
        return (
            f"skill-s{self.skill_target:g}at{self.skill_lr:g}c{self.skill_cooldown}"
            f"-cap{self.skill_cap}"
        )

    def _shape(self) -> str:
        """ "" for the default shape, else -h<heads>."""
        return "" if self.heads == 4 else f"-h{self.heads}"


def calculator_demos(
    n: int, seed: int, noise: float = 0.0, mistakes: tuple[str, ...] = ("echo",)
) -> list[Demo]:
    """Expert demonstrations written by the example's scripted expert."""
    from tracerl.models.sft import Demo

    expert = example_module("calculator", "expert")
    demos = expert.demonstrations(n, seed=seed, noise=noise, mistakes=mistakes)
    return [Demo.model_validate(d) for d in demos]


def ensure_calculator_model(recipe: CalculatorRecipe | None = None, rebuild: bool = False) -> Path:
    """The weak calculator model of `recipe`, built and cached on first use (~6 min)."""
    recipe = recipe or CalculatorRecipe()
    models = cache_dir() / "models"
    out = models / recipe.name()
    # sft.json, not config.json: sft writes it after the weights, so a model another process
    # is still writing is never taken as built.
    if (out / "sft.json").exists() and not rebuild:
        return out
    # Base, skill and habit stages of one seed and shape share a lock.
    with build_lock(f"calculator{recipe._shape()}-seed{recipe.seed}"):
        if (out / "sft.json").exists() and not rebuild:
            return out
        return _build_calculator_model(recipe, models, out, rebuild)


def _build_calculator_model(
    recipe: CalculatorRecipe, models: Path, out: Path, rebuild: bool
) -> Path:
    from tracerl.models.sft import SftConfig, sft, split_holdout
    from tracerl.models.template import render_chat
    from tracerl.models.tiny import TinyModelConfig, build_tiny_model

    clean = calculator_demos(recipe.demos, seed=recipe.seed + 1000)
    base = models / f"calculator-tiny{recipe._shape()}-base-clean-seed{recipe.seed}"
    if rebuild or not (base / "config.json").exists():
        texts = [render_chat(d.messages, d.tools) for d in clean]
        build_tiny_model(base, texts, TinyModelConfig(seed=recipe.seed, num_heads=recipe.heads))
    skilled = models / recipe.skill_name()
    skill = SftConfig(
        steps=recipe.skill_cap, lr=recipe.skill_lr, target=recipe.skill_target,
        target_metric="sampled",
        cooldown=recipe.skill_cooldown, holdout=0.1, eval_every=50, seed=recipe.seed,
        bf16=recipe.bf16,
    )  # fmt: skip
    # A killed build continues from its checkpoint (resume), a finished stage is kept.
    sft(base, clean, skilled, skill, resume=not rebuild)
    if recipe.habit_steps == 0:
        return skilled
    lazy = calculator_demos(recipe.demos, recipe.seed + 2000, recipe.lazy_rate)
    habit = SftConfig(
        steps=recipe.habit_steps, lr=recipe.habit_lr, seed=recipe.seed,
        eval_every=recipe.habit_steps, bf16=recipe.bf16,
    )  # fmt: skip
    # Scored at its end on the skill stage's held-out clean demos: the start's success.
    _, held = split_holdout(clean, skill.holdout, skill.seed)
    sft(skilled, lazy, out, habit, resume=not rebuild, score_on=held)
    return out


def start_report(recipe: CalculatorRecipe) -> list[str]:
    """What the built start measured, said before training: the skill stage's held-out
    scores (and a warning when its cap came before the target), and the estimated success
    of the weak start."""
    from tracerl.models.sft import SftResult

    models = cache_dir() / "models"
    lines = []
    skill = SftResult.model_validate_json((models / recipe.skill_name() / "sft.json").read_text())
    last = skill.held_out[-1] if skill.held_out else None
    if last is not None:
        lines.append(
            f"start: skill stage {skill.steps} steps ({skill.precision}), held-out exact match "
            f"{last.exact_match:.3f}, sampled match {last.sampled_match or 0:.3f}"
        )
    if skill.target_reached is False:
        lines.append(
            f"[yellow]warning: the skill stage's cap ({recipe.skill_cap} steps) came before its "
            f"target {recipe.skill_target:g}: RL's ceiling is the skill, so the demo may end "
            f"below 90% (rebuild with a higher --recipe.skill_cap)[/yellow]"
        )
    habit_json = models / recipe.name() / "sft.json"
    if recipe.habit_steps and habit_json.exists():
        habit = SftResult.model_validate_json(habit_json.read_text())
        if habit.held_out and habit.held_out[-1].sampled_match is not None:
            estimate = habit.held_out[-1].sampled_match
            lines.append(
                f"start: weak by design, estimated success at temperature 1 {estimate:.1%}"
            )
    return lines


def write_calculator_tasks(path: Path, train: int, held_out: int) -> Path:
    """The example's tasks as one JSONL file: `train` of split "train" (seed 0), then
    `held_out` of split "eval" (seed 1, so no held-out task is trained on)."""
    make_tasks = example_module("calculator", "tasks").make_tasks
    rows = make_tasks(train, "train", 0) + make_tasks(held_out, "eval", 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


class DemoConfig(TrainConfig):
    """Build (or reuse) the weak tiny calculator model, evaluate the calculator agent on
    held-out tasks, train it with RL through the gateway (the agent code unchanged), and
    evaluate again. Every `tracerl train` field, with the demo's defaults."""

    # The run defaults are `tracerl train`'s own; only the demo's scale is set here.
    name: str = "demo"
    """Run name: outputs go to <runs>/<name>/."""
    model: str = ""
    """Local HF model directory to start from; default: the weak tiny calculator model of
    `recipe`, built once and cached."""
    agent: str = f"{example_file('calculator', 'agent')}:run"
    """The agent: 'file.py:function', 'module:function', or 'cmd:<command line>'."""
    reward: str | None = f"{example_file('calculator', 'reward')}:reward"
    """Reward function 'file.py:function' called as f(task, answer)."""
    tasks: str = ""
    """Task file (JSONL); default: `train_tasks` + `eval_tasks` calculator tasks, written to
    <runs>/<name>/tasks.jsonl."""
    # A count here, where TrainConfig has a file: `--eval_tasks N` is the demo's own flag.
    eval_tasks: int = Field(default=200, ge=1)  # type: ignore[assignment]
    """Held-out calculator tasks generated (with a `tasks` file: its 'eval' split instead)."""
    train_tasks: int = Field(default=2000, ge=1)
    """Training calculator tasks generated."""
    recipe: CalculatorRecipe = CalculatorRecipe()
    """How the weak tiny model is built (skill SFT, then a lazy-answer bias)."""
    rebuild: bool = False
    """Rebuild the tiny model even if it is cached."""
    run_async: bool = Field(default=False, alias="async")
    """Generate while training (pipeline.mode async, max_staleness as configured)."""
    pipeline: PipelineConfig = PipelineConfig(steps=30, eval_every=10)
    """Scheduling."""
    runner: RunnerConfig = RunnerConfig(concurrency=64)
    """How rollouts are run."""
    engine: EngineConfig = EngineConfig(max_batch_size=64)
    """How the policy is served."""


_DEMO_ONLY = {"eval_tasks", "train_tasks", "recipe", "rebuild", "run_async"}


def demo_run_config(cfg: DemoConfig) -> TrainConfig:
    """The training run the demo is: its model built (or reused) and its task file written
    unless given; the config saved with the run names them, so the run resumes like any."""
    data = cfg.model_dump(exclude=_DEMO_ONLY)
    if not cfg.model:
        data["model"] = str(ensure_calculator_model(cfg.recipe, cfg.rebuild))
    if not cfg.tasks:
        out = Path(cfg.runs) / cfg.name / "tasks.jsonl"
        data["tasks"] = str(write_calculator_tasks(out, cfg.train_tasks, cfg.eval_tasks))
    if cfg.run_async:
        data["pipeline"]["mode"] = "async"
    return TrainConfig.model_validate(data)
