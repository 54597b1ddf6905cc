"""A training run's settings: scheduling (PipelineConfig) and the whole run (TrainConfig).

TrainConfig composes each part's own config (trainer, engine, runner, algorithm, curation)
once; `tracerl train` and `tracerl demo` are generated from it. Torch-free.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tracerl.algorithms.config import AlgorithmConfig, CurationConfig
from tracerl.cluster.config import ClusterConfig
from tracerl.engines.config import EngineConfig
from tracerl.roles import PolicySpec, RoleConfig, check_local_models, policy_specs, top_model
from tracerl.runner import RunnerConfig
from tracerl.trainer.config import TrainerConfig

__all__ = ["PipelineConfig", "TrainConfig"]


class PipelineConfig(BaseModel):
    """Scheduling of generation and training."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    mode: Literal["sync", "async"] = "sync"
    """'sync': each step generates its batch, then trains on it. 'async': runners and the
    engine keep generating while the trainer trains (see tracerl.sources.AsyncSource)."""
    max_staleness: int = Field(default=2, ge=0)
    """async: a rollout sampled by a policy older than current - max_staleness is not
    trained on; also bounds how far generation runs ahead ((k + 1) x tasks_per_step groups
    pending at most)."""
    window: int | None = Field(default=None, ge=1)
    """async: the trainer may take any complete group among the oldest `window` pending
    ones (windowed FIFO); default 2 x tasks_per_step."""
    stale: Literal["drop", "requeue"] = "requeue"
    """async: what happens to a too-stale rollout: dropped, or its task re-run in the same
    group (counted either way in metrics)."""
    steps: int = Field(default=30, ge=1)
    """Training steps (policy versions published)."""
    tasks_per_step: int = Field(default=16, ge=1)
    """Tasks per step; each is attempted group_size times."""
    group_size: int = Field(default=8, ge=1)
    """Rollouts per task sharing a baseline."""
    eval_every: int = Field(default=5, ge=0)
    """Held-out evaluation every this many steps (0: only before and after)."""
    eval_size: int = Field(default=100, ge=1)
    """Held-out tasks per periodic evaluation."""
    checkpoint_every: int = Field(default=1, ge=1)
    """Steps between checkpoints."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Checkpoints kept on disk."""
    seed: int = 0
    """Seed of the task order."""


class TrainConfig(BaseModel):
    """Everything a training run needs; saved as runs/<name>/config.json."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    name: str = "train"
    """Run name: outputs go to <runs>/<name>/."""
    runs: str = "runs"
    """Folder holding runs."""
    model: str = ""
    """Local HF model directory to start from."""
    agent: str = ""
    """The agent: 'file.py:function', 'module:function', or 'cmd:<command line>'."""
    reward: str | None = None
    """Reward function 'file.py:function' called as f(task, answer)."""
    store: str = ""
    """The store: "" for <runs>/<name>/traces.db (SQLite), a SQLite file, or a
    `postgresql://` URL (the same store protocol, for many gateways and runners)."""
    tasks: str = ""
    """Task file (JSONL); its 'train' split is trained on."""
    eval_tasks: str | None = None
    """Held-out task file; default: the 'eval' split of `tasks`."""
    eval_before: bool = True
    """Evaluate on all held-out tasks before training."""
    success_threshold: float = 1.0
    """A rollout with an outcome whose final reward (None read as 0) is >= this is a
    success: for the success rates logged and evaluated, and for curation."""
    model_name: str = "policy"
    """The model name the agent is told to use (the role); with `roles`, default: the first."""
    roles: dict[str, RoleConfig] = Field(default_factory=dict)
    """Multi-agent runs: each role (a `model` name the agents ask for) and its policy;
    empty: one role, `model_name`, trained from `model`."""
    pipeline: PipelineConfig = PipelineConfig()
    """Scheduling."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Credit assignment."""
    curation: CurationConfig = CurationConfig()
    """Data curation: dynamic sampling, replay, adaptive group size, conditional advantage
    (each off by default)."""
    trainer: TrainerConfig = TrainerConfig()
    """Policy update."""
    runner: RunnerConfig = RunnerConfig()
    """How rollouts are run."""
    engine: EngineConfig = EngineConfig()
    """How the policy is served."""
    device: str = Field(default="cpu")
    """torch device of the trainer ("cpu", "cuda", "cuda:1"); the engine's too unless
    engine.device is given: one switch moves the run to a GPU."""
    cluster: ClusterConfig = ClusterConfig()
    """Past one machine: Ray places the runners and trainer ranks (`--cluster.address`);
    off by default, and Ray is then never imported."""

    @model_validator(mode="after")
    def _engine_follows_device(self) -> TrainConfig:
        if "device" in self.model_fields_set and "device" not in self.engine.model_fields_set:
            self.engine = self.engine.model_copy(update={"device": self.device})
        return self

    @model_validator(mode="after")
    def _top_role(self) -> TrainConfig:
        # With roles and no model_name given, the top agent is told the first role; the
        # name is then written into the run's config, so a resumed run tells it the same.
        if "model_name" not in self.model_fields_set and self.roles:
            self.model_name = top_model(self.model_name, self.roles, named=False)
        return self

    def policies(self) -> list[PolicySpec]:
        """The run's policies resolved from `roles` (or the one `model_name` policy)."""
        return policy_specs(self.roles, self.model_name, self.model, self.trainer.lora)

    def check(self) -> None:
        """Clear errors for missing essentials (they may come from a TOML file or flags)."""
        if not self.roles and not self.model:
            raise ValueError("train needs --model (or `model = ...`, or [roles.*] with models)")
        for field in ("agent", "tasks"):
            if not getattr(self, field):
                raise ValueError(f"train needs --{field} (or `{field} = ...` in the config file)")
        check_local_models(self.policies(), bool(self.roles))
        top_model(self.model_name, self.roles, named=True)
        unknown = sorted(set(self.algorithm.align) - set(self.roles or [self.model_name]))
        if unknown:
            raise ValueError(
                f"algorithm.align names {unknown}, not roles of this run "
                f"{sorted(self.roles or [self.model_name])}"
            )
