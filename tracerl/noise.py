"""Environment noise for agents' tools: a curriculum of perturbed tool results (NoisyAgent).

Real tools fail, lag and return wrong values; an agent trained only on clean tools is
brittle. With `--runner.noise.p1 0.3` (and optionally `p0`, `ramp_steps`) the runner gives
each rollout a noise spec in its task input (under `tracerl_noise`), and an agent that
exposes its tools through the hook perturbs each tool call's result with the scheduled
probability:

    if "tracerl_noise" in task:            # imported here, so the agent runs without tracerl
        from tracerl import noise
        tools = noise.wrap(tools, task)     # {name: function returning text}

A perturbation is one of: `drop` (the tool returns nothing), `corrupt` (one digit of its
result changes), `delay` (it answers right, `delay_s` late) or `error` (an error message
instead of the result). The probability ramps linearly from `p0` at step 0 to `p1` at
`ramp_steps` (the published policy version is the step), and only `fraction` of rollouts
get any noise, so a batch mixes clean and noisy rollouts.

Each rollout's count of perturbations is recorded as a Reward named "noise" (value = the
count) on its attempt: the store needs no new column, it dies with an abandoned attempt
like the attempt's spans, `tracerl traces show` prints it, and the trace filter reads it
(`--filter 'noise == 0'`). It never enters a return: the training side credits outcome,
role and step rewards only, and the runner skips it when looking for an emitted reward.
Counting works for agents in the runner's process (Python agents); an external command
may apply the same spec, but its perturbations are not counted.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from tracerl.store import Store
    from tracerl.types import Task

__all__ = [
    "NOISE_REWARD",
    "SPEC_KEY",
    "NoiseConfig",
    "NoiseSpec",
    "ToolNoise",
    "noise_step",
    "spec_for",
    "take_applied",
    "with_spec",
    "wrap",
]

NOISE_REWARD = "noise"
"""Name of the Reward record holding a rollout's number of perturbations."""
SPEC_KEY = "tracerl_noise"
"""Key of the noise spec in the task input the agent receives."""

Kind = Literal["drop", "corrupt", "delay", "error"]


class NoiseConfig(BaseModel):
    """The noise curriculum a runner applies (off while p0 and p1 are both 0)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    p0: float = Field(default=0.0, ge=0.0, le=1.0)
    """Probability that a tool call is perturbed at step 0."""
    p1: float = Field(default=0.0, ge=0.0, le=1.0)
    """Probability at `ramp_steps` and after (with ramp_steps 0: at every step)."""
    ramp_steps: int = Field(default=0, ge=0)
    """Steps (published policy versions) of the linear ramp from p0 to p1."""
    fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    """Share of rollouts that get noise at all; the others run clean."""
    kinds: list[Kind] = ["drop", "corrupt", "delay", "error"]
    """Perturbations to draw from, uniformly."""
    delay_s: float = Field(default=1.0, ge=0.0)
    """How late a `delay` perturbation answers."""
    error_text: str = "error: the tool did not answer (timeout)"
    """What an `error` perturbation returns instead of the result."""
    seed: int = 0
    """Seed: the same rollout, attempt and seed draw the same perturbations."""

    @property
    def enabled(self) -> bool:
        """Whether any tool call can be perturbed."""
        return self.p0 > 0 or self.p1 > 0

    def probability(self, step: int) -> float:
        """The per-call probability at `step`: linear from p0 to p1 over ramp_steps."""
        if self.ramp_steps == 0:
            return self.p1
        t = min(max(step, 0) / self.ramp_steps, 1.0)
        return self.p0 + (self.p1 - self.p0) * t


class NoiseSpec(BaseModel):
    """One rollout's noise, as the agent receives it in its task input."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    """Key under which this process counts the perturbations (rollout id and attempt)."""
    p: float = Field(ge=0.0, le=1.0)
    """Probability that each tool call is perturbed (0 for a rollout left clean)."""
    kinds: list[Kind]
    """Perturbations to draw from."""
    delay_s: float
    """How late a `delay` answers."""
    error_text: str
    """What an `error` returns."""
    seed: int
    """Seed of this rollout's draws."""


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


def spec_for(cfg: NoiseConfig, rollout_id: str, attempt: int, step: int) -> NoiseSpec:
    """The spec of one attempt at `step`: deterministic in (rollout, attempt, seed)."""
    seed = _seed(rollout_id, attempt, cfg.seed)
    noisy = random.Random(seed).random() < cfg.fraction
    return NoiseSpec(
        id=f"{rollout_id}/{attempt}",
        p=cfg.probability(step) if noisy else 0.0,
        kinds=cfg.kinds,
        delay_s=cfg.delay_s,
        error_text=cfg.error_text,
        seed=seed + 1,
    )


def noise_step(store: Store, role: str) -> int:
    """The schedule's step: the newest published version of the role's policy (0 before
    any, and for a role without versions of its own, the default policy's)."""
    latest = store.latest_version(role) or store.latest_version()
    return latest.version if latest else 0


def with_spec(task: Task, spec: NoiseSpec) -> Task:
    """The task as the agent sees it: its input plus the noise spec."""
    return task.model_copy(update={"input": {**task.input, SPEC_KEY: spec.model_dump()}})


_lock = threading.Lock()
_applied: dict[str, list[str]] = {}
# Perturbations applied per spec id in this process: the agent's wrapper writes, the
# runner takes them once the rollout ends.


def take_applied(spec_id: str) -> list[str]:
    """The perturbations applied under `spec_id` (kinds, in order), forgotten once taken."""
    with _lock:
        return _applied.pop(spec_id, [])


def _corrupt(text: str, rng: random.Random) -> str | None:
    """`text` with one digit changed to another, or None when it has no digit."""
    spots = [i for i, ch in enumerate(text) if ch.isdigit()]
    if not spots:
        return None
    i = rng.choice(spots)
    new = rng.choice([d for d in "0123456789" if d != text[i]])
    return text[:i] + new + text[i + 1 :]


class ToolNoise:
    """Perturbs tool results for one rollout as its spec says, counting what it did."""

    def __init__(self, spec: NoiseSpec) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.lock = threading.Lock()  # an agent may run tools in threads

    def perturb(self, result: str) -> str:
        """The result as the agent sees it (perturbed with probability spec.p)."""
        with self.lock:
            if self.rng.random() >= self.spec.p:
                return result
            kind = self.rng.choice(self.spec.kinds)
            out = _corrupt(result, self.rng) if kind == "corrupt" else None
        if kind == "corrupt" and out is None:
            kind = "error"  # nothing numeric to corrupt: the tool fails instead
        with _lock:
            _applied.setdefault(self.spec.id, []).append(kind)
        if kind == "delay":
            time.sleep(self.spec.delay_s)
            return result
        return {"drop": "", "error": self.spec.error_text}.get(kind, out or result)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., str]:
        """`fn` with its (text) result perturbed."""

        def noisy(*args: Any, **kwargs: Any) -> str:
            return self.perturb(str(fn(*args, **kwargs)))

        return noisy


def wrap(
    tools: Mapping[str, Callable[..., Any]], task: Mapping[str, Any]
) -> dict[str, Callable[..., Any]]:
    """The agent's tools ({name: function returning text}) with the task's noise applied;
    unchanged when the task carries no noise spec."""
    raw = task.get(SPEC_KEY)
    if raw is None:
        return dict(tools)
    noise = ToolNoise(NoiseSpec.model_validate(raw))
    return {name: noise.wrap(fn) for name, fn in tools.items()}
