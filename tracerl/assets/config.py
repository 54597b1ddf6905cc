"""Asset settings, torch-free (the CLI reads them for --help): how the gateway applies an
asset (AssetUse, in GatewayConfig.assets) and how a training run internalizes one
(AssetsConfig, TrainConfig.assets)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from tracerl.assets.apply import Mode
from tracerl.assets.records import AssetName, Test

__all__ = ["AssetUse", "AssetsConfig", "CurriculumConfig", "OptimizeSettings"]


class AssetUse(BaseModel):
    """How the gateway applies one asset to the calls it serves."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", frozen=True)

    version: int | None = Field(default=None, ge=1, lt=2**31)
    """The version applied; None: the current one, looked up once per rollout attempt (so
    a rollout's calls all see one version, even if a new one is put meanwhile)."""
    mode: Mode = "append"
    """'append': after the system message's text; 'replace': instead of it. A request
    without a system message gets one."""
    roles: list[str] | None = None
    """Only calls of these roles (model names); None: every role."""


class CurriculumConfig(BaseModel):
    """An asset given to each training rollout with a probability that falls linearly from
    `start` to `end` over `steps` training steps (then stays at `end`)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", frozen=True)

    name: AssetName
    """The asset (in the run's store; put it with `tracerl assets put NAME FILE --store`)."""
    version: int | None = Field(default=None, ge=1, lt=2**31)
    """Its version; None: the current one when the run starts (recorded in the metrics)."""
    start: float = Field(default=1.0, ge=0, le=1)
    """Probability that a rollout carries the asset at step 0."""
    end: float = Field(default=0.0, ge=0, le=1)
    """Probability from step `steps` on."""
    steps: int = Field(default=20, ge=1)
    """Training steps over which it falls from `start` to `end`."""
    seed: int = 0
    """Seed of the per-rollout draws."""
    distill: bool = True
    """Also train each carried rollout's reply on the prompt without the asset (the gateway
    records its ids: GatewayConfig.unassisted), with its advantage where positive, weighted
    as if sampled there: the weights learn to answer as the asset told them in the context
    they are evaluated in (algorithms/rows.py). False: only as sampled, under the asset
    (on SmolLM2 nothing learned there carried over to prompts without it: README)."""

    def probability(self, step: int) -> float:
        """The chance that a rollout issued at `step` carries the asset."""
        done = min(max(step, 0) / self.steps, 1.0)
        return self.start + (self.end - self.start) * done


class AssetsConfig(BaseModel):
    """Assets in a training run: a curriculum that withdraws one from the rollouts while
    the weights learn what it said. Held-out evaluations always run without it."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    curriculum: CurriculumConfig | None = None
    """E.g. {"name": "format", "start": 1.0, "end": 0.0, "steps": 20}; None: off."""


class OptimizeSettings(BaseModel):
    """How an optimization searches and what it must show to be accepted."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", frozen=True)

    rounds: int = Field(default=3, ge=1)
    """Rounds of proposals at most (fewer when the best solves every train pair)."""
    candidates: int = Field(default=3, ge=1)
    """Candidates asked of the proposer per round."""
    repeats: int = Field(default=1, ge=1)
    """Rollouts per task in each arm (paired by repeat)."""
    alpha: float = Field(default=0.05, gt=0, lt=1)
    """The best is accepted only with a held-out p-value below this."""
    test: Test = "mcnemar"
    """The paired test: exact McNemar, or a bootstrap over tasks."""
    cases: int = Field(default=4, ge=1)
    """Failures shown to the proposer per round."""
    seed: int = 0
    """Base of the per-pair sampling seeds."""
