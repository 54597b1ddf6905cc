"""SFT recipes: the whole skill first, then (optionally) a habit made from the same demos.

`skill-then-habit` is how tracerl's benchmarks build a weak start that RL can fix, for any
tool-using task (docs/recipes.md says why a start made weak by undertraining is a poor one):

1. skill: SFT on the clean demonstrations, so the model knows the task end to end (for a
   fixed number of steps, or with `SftConfig.target` until that share of held-out
   demonstrations is copied exactly);
2. habit: a short, gentle SFT from the skilled model on a mixture where `habit_rate` of the
   demonstrations are degraded copies that `degrade` makes itself.

A degraded demonstration skips every tool: its tool calls and tool results are cut, and the
assistant answers at once with the expert's final answer corrupted (one character changed
to another of its kind), a tool-free guess of the right form and wrong content. That is
generic: it needs no knowledge of the task, only the conversation's shape. The model that
comes out knows how to use its tools and often does not, and the reward tells RL which
habit is wrong.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from tracerl.models.sft import (
    Demo,
    Say,
    SftConfig,
    SftResult,
    sft,
    sft_new_or_base,
    split_holdout,
)

__all__ = ["HabitStage", "corrupt", "degrade", "skill_then_habit"]

Recipe = Literal["plain", "skill-then-habit"]


class HabitStage(BaseModel):
    """The second stage of `skill-then-habit`."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    rate: float = Field(default=0.65, ge=0.0, le=1.0)
    """Share of the stage's demonstrations that are degraded (answer without the tools)."""
    steps: int = Field(default=150, ge=1)
    """SFT steps of the stage."""
    lr: float = Field(default=2e-4, gt=0)
    """Peak learning rate of the stage: gentle, so the habit changes and the skill stays
    (at 1e-3 the calculator model also lost its copying skill)."""


def corrupt(text: str, rng: random.Random) -> str:
    """`text` with one digit or letter replaced by another of its kind (a digit appended
    when it has neither)."""
    spots = [i for i, ch in enumerate(text) if ch.isalnum()]
    if not spots:
        return text + str(rng.randint(0, 9))
    i = rng.choice(spots)
    pool = string.digits if text[i].isdigit() else string.ascii_lowercase
    new = rng.choice([c for c in pool if c != text[i].lower()])
    return text[:i] + (new.upper() if text[i].isupper() else new) + text[i + 1 :]


def degrade(demo: Demo, rng: random.Random) -> Demo:
    """The demo answered without tools: the conversation up to its first assistant turn,
    then the expert's final answer, corrupted."""
    messages = demo.messages
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    final = next(
        (m for m in reversed(messages) if m.get("role") == "assistant" and m.get("content")),
        None,
    )
    if first is None or final is None:
        return demo
    answer: dict[str, JsonValue] = {
        "role": "assistant",
        "content": corrupt(str(final["content"]), rng),
    }
    return Demo(messages=[*messages[:first], answer], tools=demo.tools)


def _ignore(stage: str, result: SftResult) -> None:
    pass


def skill_then_habit(
    demos: list[Demo], out_dir: str | Path, base_dir: str | Path | None, skill: SftConfig,
    habit: HabitStage, on_stage: Callable[[str, SftResult], None] = _ignore,
    resume: bool = False, say: Say | None = None,
) -> tuple[SftResult, SftResult]:  # fmt: skip
    """Stage one into <out_dir>-skill, stage two from it into `out_dir`; `on_stage` hears
    of each ("skill", then "habit") as it ends. The habit stage mixes all `demos`, held-out
    ones included: only the skill stage is scored. With `resume` a finished stage is kept
    and an interrupted one continues from its checkpoint."""
    out = Path(out_dir)
    skilled = sft_new_or_base(
        demos, out.with_name(out.name + "-skill"), base_dir, skill, resume=resume, say=say
    )
    on_stage("skill", skilled)
    rng = random.Random(skill.seed + 1)
    mixed = [degrade(d, rng) if rng.random() < habit.rate else d for d in demos]
    cfg = skill.model_copy(
        update={"steps": habit.steps, "lr": habit.lr, "stop_loss": None, "holdout": 0.0,
                "target": None, "eval_every": habit.steps}
    )  # fmt: skip
    # Scored once at its end on the skill stage's held-out clean demos: their sampled match
    # estimates the start's success at temperature 1 (how weak the habit left it).
    _, held = split_holdout(demos, skill.holdout, skill.seed)
    habituated = sft(skilled.out_dir, mixed, out, cfg, resume=resume, say=say, score_on=held)
    on_stage("habit", habituated)
    return skilled, habituated
