"""How finished rollouts become training rows: credit assignment and data curation.

Torch-free, so reading a config stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

if TYPE_CHECKING:
    from tracerl.algorithms.advantages import Algorithm

__all__ = ["AlgorithmConfig", "CurationConfig", "Secondary"]

Secondary = Literal["calls", "tokens"]


class AlgorithmConfig(BaseModel):
    """Credit assignment: how rewards become per-token advantages."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    name: Literal["grpo", "rloo", "drgrpo"] = "grpo"
    """GRPO (group baseline, std scaling), RLOO (leave-one-out), Dr.GRPO (unnormalised)."""
    scale_by_std: bool = True
    """GRPO only: divide by the group's reward std."""
    normalize: Literal["token", "sequence", "none"] = "token"
    """Per-rollout weighting so a rollout with more calls does not weigh more."""
    align: dict[str, PositiveInt] = Field(default_factory=dict)
    """M-GRPO trajectory alignment: role -> rows every rollout gives that role (e.g.
    {"executor": 2}): extra sub-agent rows are dropped at random, missing ones are copies of
    the rollout's own rows, so the role's batch has a fixed size. Empty: every row kept."""

    def build(self) -> Algorithm:
        """The algorithm object."""
        from tracerl.algorithms.advantages import GRPO, RLOO, DrGRPO

        align = dict(self.align)
        if self.name == "grpo":
            return GRPO(scale_by_std=self.scale_by_std, normalize=self.normalize, align=align)
        if self.name == "rloo":
            return RLOO(normalize=self.normalize, align=align)
        return DrGRPO(normalize=self.normalize, align=align)


class CurationConfig(BaseModel):
    """Which data-curation switches are on; all off by default."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    dynamic_sampling: bool = False
    """Drop groups whose finished rollouts all got the same final reward (DAPO)."""
    replay: bool = False
    """Put a stored success of a rarely solved task into its next all-fail group (DART)."""
    replay_capacity: int = Field(default=4, ge=1)
    """Successful rollouts remembered per task; the newest are kept."""
    replay_max_success_rate: float = Field(default=0.25, ge=0.0, le=1.0)
    """Only tasks whose success rate over every finished rollout observed so far is at most
    this get replays."""
    adaptive_group_size: bool = False
    """Size each task's group from its recent outcomes (rule: `AdaptiveGroupSize`)."""
    group_size_min: int = Field(default=2, ge=1)
    """Smallest group issued; tasks always solved or always failed get it."""
    group_size_max: int = Field(default=16, ge=1)
    """Largest group issued."""
    group_size_window: int = Field(default=32, ge=1)
    """How many recent finished outcomes of a task the size rule looks at."""
    group_size_minority: float = Field(default=2.0, gt=0)
    """Rollouts of the rarer outcome a mixed task's group is sized to hold on average."""
    conditional_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the conditional cost advantage among correct rollouts; 0 turns it off."""
    secondary: Secondary = "calls"
    """The cost the conditional advantage lowers: 'calls' (model calls = spans of the
    rollout) or 'tokens' (sampled completion tokens of the rollout)."""
    conditional_scale_by_pass_rate: bool = False
    """DDCA: scale conditional_coef by the group's pass rate, so easy tasks push harder for
    economy and hard ones keep their budget."""

    @property
    def enabled(self) -> bool:
        """Whether any switch is on."""
        return (
            self.dynamic_sampling
            or self.replay
            or self.adaptive_group_size
            or self.conditional_coef > 0
        )

    @model_validator(mode="after")
    def _sizes(self) -> CurationConfig:
        if self.group_size_min > self.group_size_max:
            raise ValueError("group_size_min must be <= group_size_max")
        return self
