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

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from tracerl.engines.config import EngineConfig
from tracerl.examples import example_dir, example_file, example_module
from tracerl.pipeline.config import PipelineConfig, TrainConfig
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
    "example_dir",
    "example_module",
    "write_calculator_tasks",
]


def cache_dir() -> Path:
    """Where built models are kept: $TRACERL_HOME, else ~/.cache/tracerl."""
    return Path(os.environ.get("TRACERL_HOME", Path.home() / ".cache" / "tracerl"))


class CalculatorRecipe(BaseModel):
    """How the demo's weak calculator model is made: first the skill, then a habit to unlearn.

    A model that is weak because it is undertrained (early-stopped SFT) is a poor RL start:
    learning to copy digits is a sudden transition whose step varies with the data order, so
    the warm start is erratic (3-80% success), and RL has to teach the copy skill itself,
    slowly. Instead the model first learns the whole task from clean demonstrations (~96%
    success), then a short second SFT on demonstrations where a lazy expert often answers
    with the unevaluated expression instead of calling the calculator. The result knows how
    to use the tool but mostly does not (~30-38% success at temperature 1): the situation of
    an agent whose model under-uses its tools, and the one RL fixes from rewards alone.

    The skill stage sets RL's ceiling: RL teaches the habit, not the copying, and the
    failures left after RL are miscopied numbers. 1,500 skill steps (96.0% success at
    temperature 1, over 400 rollouts) end the demo at 94.5-98% held out; 1,000 (90.8%) ended
    it at 88.5-91.5%. The seed matters more than the steps: seed 1's base model learns to
    copy late (held-out exact match 0.85 at 1,500 steps, 0.91 at 3,000; seed 0's 0.97, 0.98).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    demos: int = Field(default=4000, ge=1)
    """Expert demonstrations per stage."""
    skill_steps: int = Field(default=1500, ge=1)
    """SFT steps on clean demonstrations (lr 2e-3, batch 16)."""
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

    def name(self) -> str:
        """The cache directory name: one per distinct recipe."""
        return (
            f"calculator-tiny{self._shape()}-skill{self.skill_steps}-lazy{self.lazy_rate:g}x"
            f"{self.habit_steps}at{self.habit_lr:g}-n{self.demos}-seed{self.seed}"
        )

    def _shape(self) -> str:
        """ "" for the default shape (so existing caches stay valid), else -h<heads>."""
        return "" if self.heads == 4 else f"-h{self.heads}"


def calculator_demos(
    n: int, seed: int, noise: float = 0.0, mistakes: tuple[str, ...] = ("echo",)
) -> list[Demo]:
    """Expert demonstrations written by the example's scripted expert."""
    from tracerl.models.sft import Demo

    expert = example_module("calculator", "expert")
    demos = expert.demonstrations(n, seed=seed, noise=noise, mistakes=mistakes)
    return [Demo.model_validate(d) for d in demos]


@contextmanager
def _build_lock(models: Path) -> Iterator[None]:
    """One builder at a time per cache (two test sessions, or a demo beside a test run):
    the second waits, then finds the model built."""
    models.mkdir(parents=True, exist_ok=True)
    with open(models / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_calculator_model(recipe: CalculatorRecipe | None = None, rebuild: bool = False) -> Path:
    """The weak calculator model of `recipe`, built and cached on first use (~6 min)."""
    recipe = recipe or CalculatorRecipe()
    models = cache_dir() / "models"
    out = models / recipe.name()
    if (out / "config.json").exists() and not rebuild:
        return out
    with _build_lock(models):
        if (out / "config.json").exists() and not rebuild:
            return out
        return _build_calculator_model(recipe, models, out, rebuild)


def _build_calculator_model(
    recipe: CalculatorRecipe, models: Path, out: Path, rebuild: bool
) -> Path:
    from tracerl.models.sft import SftConfig, sft
    from tracerl.models.template import render_chat
    from tracerl.models.tiny import TinyModelConfig, build_tiny_model

    clean = calculator_demos(recipe.demos, seed=recipe.seed + 1000)
    base = models / f"calculator-tiny{recipe._shape()}-base-clean-seed{recipe.seed}"
    if rebuild or not (base / "config.json").exists():
        texts = [render_chat(d.messages, d.tools) for d in clean]
        build_tiny_model(base, texts, TinyModelConfig(seed=recipe.seed, num_heads=recipe.heads))
    skilled = (
        models / f"calculator-tiny{recipe._shape()}-skill{recipe.skill_steps}-seed{recipe.seed}"
    )
    if rebuild or not (skilled / "config.json").exists():
        sft(base, clean, skilled, SftConfig(steps=recipe.skill_steps, seed=recipe.seed))
    if recipe.habit_steps == 0:
        return skilled
    lazy = calculator_demos(recipe.demos, recipe.seed + 2000, recipe.lazy_rate)
    habit = SftConfig(steps=recipe.habit_steps, lr=recipe.habit_lr, seed=recipe.seed)
    sft(skilled, lazy, out, habit)
    return out


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
