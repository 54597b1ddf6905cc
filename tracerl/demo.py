"""The calculator demo's pieces: where the example lives and its warm-started tiny model.

The model is built once and cached: expert demonstrations from the example's own code,
a tokenizer and a random-init tiny Llama trained on their text, then a supervised warm start
in two stages that leaves the agent weak (roughly 25-35% success) so RL has room to work;
see CalculatorRecipe for why two stages.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from pydantic import BaseModel, ConfigDict, Field

from tracerl.models.sft import Demo, SftConfig, sft
from tracerl.models.template import render_chat
from tracerl.models.tiny import TinyModelConfig, build_tiny_model


def cache_dir() -> Path:
    """Where built models are kept: $TRACERL_HOME, else ~/.cache/tracerl."""
    return Path(os.environ.get("TRACERL_HOME", Path.home() / ".cache" / "tracerl"))


def example_dir(name: str = "calculator") -> Path:
    """The example folder, next to the package in a checkout, else under the cwd."""
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        path = root / "examples" / name
        if path.is_dir():
            return path
    raise FileNotFoundError(f"examples/{name} not found next to tracerl or in {Path.cwd()}")


def example_module(name: str, module: str) -> ModuleType:
    """Import examples/<name>/<module>.py by path (examples are not a package)."""
    path = example_dir(name) / f"{module}.py"
    key = f"tracerl_example_{name}_{module}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    sys.modules[key] = mod
    spec.loader.exec_module(mod)
    return mod


class CalculatorRecipe(BaseModel):
    """How the demo's weak calculator model is made: first the skill, then a habit to unlearn.

    A model that is weak because it is undertrained (early-stopped SFT) is a poor RL start:
    learning to copy digits is a sudden transition whose step varies with the data order, so
    the warm start is erratic (3-80% success), and RL has to teach the copy skill itself,
    slowly. Instead the model first learns the whole task from clean demonstrations (~95%
    success), then a short second SFT on demonstrations where a lazy expert often answers
    with the unevaluated expression instead of calling the calculator. The result knows how
    to use the tool but mostly does not (~25-35% success at temperature 1): the situation of
    an agent whose model under-uses its tools, and the one RL fixes from rewards alone.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    demos: int = Field(default=4000, ge=1)
    """Expert demonstrations per stage."""
    skill_steps: int = Field(default=1000, ge=1)
    """SFT steps on clean demonstrations (lr 2e-3, batch 16)."""
    lazy_rate: float = Field(default=0.65, ge=0.0, le=1.0)
    """Share of stage-two demonstrations that answer without the calculator."""
    habit_steps: int = Field(default=150, ge=0)
    """SFT steps on the lazy mixture."""
    habit_lr: float = 2e-4
    """Peak learning rate of stage two; at 1e-3 it also erodes the copy skill."""
    seed: int = 0
    """Seed of the model, the demonstrations and their order."""

    def name(self) -> str:
        """The cache directory name: one per distinct recipe."""
        return (
            f"calculator-tiny-skill{self.skill_steps}-lazy{self.lazy_rate:g}x"
            f"{self.habit_steps}at{self.habit_lr:g}-n{self.demos}-seed{self.seed}"
        )


def calculator_demos(
    n: int, seed: int, noise: float = 0.0, mistakes: tuple[str, ...] = ("echo",)
) -> list[Demo]:
    """Expert demonstrations written by the example's scripted expert."""
    expert = example_module("calculator", "expert")
    demos = expert.demonstrations(n, seed=seed, noise=noise, mistakes=mistakes)
    return [Demo.model_validate(d) for d in demos]


def ensure_calculator_model(recipe: CalculatorRecipe | None = None, rebuild: bool = False) -> Path:
    """The weak calculator model of `recipe`, built and cached on first use (~5 min)."""
    recipe = recipe or CalculatorRecipe()
    out = cache_dir() / "models" / recipe.name()
    if (out / "config.json").exists() and not rebuild:
        return out
    models = cache_dir() / "models"
    clean = calculator_demos(recipe.demos, seed=recipe.seed + 1000)
    base = models / f"calculator-tiny-base-clean-seed{recipe.seed}"
    if rebuild or not (base / "config.json").exists():
        texts = [render_chat(d.messages, d.tools) for d in clean]
        build_tiny_model(base, texts, TinyModelConfig(seed=recipe.seed))
    skilled = models / f"calculator-tiny-skill{recipe.skill_steps}-seed{recipe.seed}"
    if rebuild or not (skilled / "config.json").exists():
        sft(base, clean, skilled, SftConfig(steps=recipe.skill_steps, seed=recipe.seed))
    if recipe.habit_steps == 0:
        return skilled
    lazy = calculator_demos(recipe.demos, recipe.seed + 2000, recipe.lazy_rate)
    habit = SftConfig(steps=recipe.habit_steps, lr=recipe.habit_lr, seed=recipe.seed)
    sft(skilled, lazy, out, habit)
    return out
