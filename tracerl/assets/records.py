"""What the store keeps of assets: their versions, the comparisons run between versions, and
the optimizations that searched for better ones. Frozen, typed, a docstring on every field;
stored as rows (assets) or as JSON bodies under an id (comparisons, optimizations).

Versions of one asset count from 1. Version 0 names no text: an arm of a comparison, or a
rollout, that runs without the asset. A candidate is a version an optimizer proposed: kept
for comparison and audit but never current; an accepted candidate becomes current by being
put again as a plain version.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ASSET_NAME",
    "Asset",
    "AssetName",
    "AssetRef",
    "Candidate",
    "Comparison",
    "Optimization",
    "OptimizationRound",
    "Pair",
    "Test",
]

ASSET_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
"""An asset's name: letters, digits, '_', '.', '-' (no '@', which starts a version)."""
AssetName = Annotated[str, Field(pattern=ASSET_NAME)]
"""A name that matches ASSET_NAME."""
Version = Annotated[int, Field(ge=0, lt=2**31)]
"""An asset version: 1, 2, ... (0: without the asset)."""
Test = Literal["mcnemar", "bootstrap"]
"""The paired significance test: exact McNemar over the discordant pairs, or a bootstrap of
the paired difference of success rates resampling tasks (repeats of a task stay together)."""


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Asset(_Record):
    """One version of a named text: a system prompt, a skill, an SOP."""

    name: AssetName
    """The asset's name."""
    version: int = Field(ge=1, lt=2**31)
    """1 for the first text put under the name, one more for each after."""
    text: str = Field(min_length=1)
    """The text the gateway adds to the system message."""
    note: str = ""
    """Why this version exists (a person's note, or what an optimizer made it from)."""
    candidate: bool = False
    """An optimizer's proposal: comparable and kept, never the current version."""
    created_at: float = Field(default_factory=time.time)
    """When it was put."""


class AssetRef(_Record):
    """A reference as a person writes it: NAME (the current version), NAME@3 or NAME@v3,
    NAME@0 (without the asset)."""

    name: AssetName
    """The asset."""
    version: Version | None = None
    """The version; None: the current one, resolved when used."""

    @classmethod
    def parse(cls, text: str) -> AssetRef:
        """NAME, NAME@N or NAME@vN; ValueError saying what is wrong."""
        name, sep, version = text.strip().partition("@")
        if not re.match(ASSET_NAME, name):
            raise ValueError(f"{text!r}: expected NAME, NAME@N or NAME@vN ({ASSET_NAME})")
        if not sep:
            return cls(name=name)
        digits = version.removeprefix("v")
        if not digits.isdigit() or int(digits) >= 2**31:
            raise ValueError(f"{text!r}: the version after @ must be a number (NAME@3, NAME@v3)")
        return cls(name=name, version=int(digits))

    def __str__(self) -> str:
        return self.name if self.version is None else f"{self.name}@{self.version}"


class Pair(_Record):
    """One task attempt run in both arms of a comparison, under the same sampling seed."""

    task_id: str
    """The task."""
    repeat: int = Field(ge=0)
    """Which repeat of the task (pairs the arms' rollouts with the same seed)."""
    a: bool
    """Whether arm A's rollout succeeded (an outcome with reward >= the threshold)."""
    b: bool
    """Whether arm B's rollout succeeded."""
    rollout_a: str
    """Arm A's rollout, for its trace."""
    rollout_b: str
    """Arm B's rollout."""


class Comparison(_Record):
    """Two versions of an asset run on the same tasks with the same seeds: each one's success,
    what B repairs and what it breaks, and whether the difference is more than chance."""

    id: str
    """Unique id."""
    name: AssetName
    """The asset compared."""
    a: Version
    """Arm A's version (the incumbent; 0: without the asset)."""
    b: Version
    """Arm B's version (the candidate)."""
    pairs: list[Pair]
    """Every paired attempt, in task order."""
    success_a: float
    """Arm A's success rate over the pairs."""
    success_b: float
    """Arm B's success rate over the pairs."""
    repairs: int
    """Pairs B solves and A does not: what the candidate fixes."""
    regressions: int
    """Pairs A solves and B does not: what the candidate breaks."""
    p_value: float = Field(ge=0, le=1)
    """Two-sided p-value of `test` for "A and B succeed equally often"."""
    test: Test = "mcnemar"
    """The paired test that gave p_value."""
    purpose: str = "compare"
    """Why it ran: "compare" (a person asked), "train" (an optimizer's search on its train
    split), "held-out" (an optimizer's final test)."""
    optimization: str | None = None
    """The optimization it belongs to, if any."""
    seed: int = 0
    """Base of the per-pair sampling seeds."""
    created_at: float = Field(default_factory=time.time)
    """When it finished."""

    @property
    def label(self) -> str:
        """'name@a vs name@b'."""
        return f"{self.name}@{self.a} vs {self.name}@{self.b}"


class Candidate(_Record):
    """One proposed revision, as an optimization round judged it."""

    version: int = Field(ge=1)
    """Its asset version (a candidate version in the store)."""
    parent: int = Field(ge=1)
    """The version it revises."""
    proposer: str
    """Who wrote it: "llm:<model>" or "bootstrap"."""
    proposer_rollout: str | None = None
    """The rollout holding the proposer's own model calls (None: it made none)."""
    success: float
    """Its success rate on the train split."""
    solved: list[str]
    """The train pairs it solved, as "task_id#repeat"."""
    comparison: str
    """Its comparison against the round's best."""
    kept: bool
    """Whether the archive kept it: it solves some pair no better kept version solves."""


class OptimizationRound(_Record):
    """One round: proposals from the best version's traces, each run on the train split."""

    index: int = Field(ge=1)
    """1 for the first round."""
    parent: int = Field(ge=1)
    """The version revised this round (the best so far)."""
    candidates: list[Candidate]
    """What was proposed and how each did."""
    archive: list[int]
    """The versions kept after the round: per task, those that solve it (a Pareto front of
    per-pair successes), so complementary candidates survive."""
    best: int = Field(ge=1)
    """The archive's best on the train split after the round."""
    proposer_prompt: str = ""
    """What the proposer was shown (for the LLM proposer, its user message)."""


class Optimization(_Record):
    """A search for a better version of an asset, from its recorded traces."""

    id: str
    """Unique id."""
    name: AssetName
    """The asset optimized."""
    seed: int = Field(ge=1)
    """The version it started from."""
    proposer: str
    """"llm:<model>" or "bootstrap"."""
    status: Literal["running", "accepted", "rejected", "failed"] = "running"
    """running; accepted (a new current version); rejected (no candidate won on held-out
    tasks with significance); failed (an error, in `error`)."""
    rounds: list[OptimizationRound] = Field(default_factory=list)
    """The rounds so far."""
    best: int | None = None
    """The best candidate on the train split (None before the first round)."""
    final: str | None = None
    """The held-out comparison of the seed against the best."""
    p_value: float | None = None
    """That comparison's p-value."""
    alpha: float = Field(default=0.05, gt=0, lt=1)
    """The best is accepted only if it wins on held-out tasks with p below this."""
    accepted: int | None = None
    """The version put as current when accepted (a plain copy of the best's text)."""
    error: str | None = None
    """Why it failed."""
    created_at: float = Field(default_factory=time.time)
    """When it started."""
    updated_at: float = Field(default_factory=time.time)
    """When it was last recorded."""
