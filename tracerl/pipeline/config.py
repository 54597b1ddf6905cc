"""A training run's settings: scheduling (PipelineConfig) and the whole run (TrainConfig).

TrainConfig composes each part's own config (trainer, engine, runner, algorithm, curation)
once; `tracerl train` and `tracerl demo` are generated from it. Torch-free.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tracerl.algorithms.config import AlgorithmConfig, CurationConfig
from tracerl.assets.config import AssetsConfig
from tracerl.cluster.config import ClusterConfig
from tracerl.engines.config import EngineConfig
from tracerl.roles import (
    GatewayConfig,
    PolicySpec,
    ReplyFormat,
    RoleConfig,
    Thinking,
    ToolParser,
    check_local_models,
    policy_specs,
    top_model,
)
from tracerl.runner import RunnerConfig
from tracerl.trainer.config import TrainerConfig

__all__ = ["GuardConfig", "PipelineConfig", "TrainConfig"]


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
    eval_size: int | None = Field(default=None, ge=1)
    """Held-out tasks per periodic evaluation (the first this many); None: all of them, so
    every evaluation of a run scores the same tasks and the best checkpoint is chosen by the
    measure the final evaluation uses (a subset's score differs by the subset's difficulty as
    well as by chance: the best of a run's scores on the first 100 of 200 tasks read 3.6
    points above the same checkpoint's on all 200, over 8 transfer runs)."""
    checkpoint_every: int = Field(default=1, ge=1)
    """Steps between checkpoints."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Checkpoints kept on disk."""
    seed: int = 0
    """Seed of the task order."""


class GuardConfig(BaseModel):
    """Guard rails (tracerl.pipeline.guards, tracerl.pipeline.preflight): each on by default
    but rollback, each logged under guard/ and as a warning in the progress line."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    preflight: bool = True
    """Before training, run `preflight_tasks` training tasks x group_size and report reward
    variance, rollouts failing with errors, prompts near the context limit and what the
    failures look like; refuse to train when the reward never varies."""
    preflight_tasks: int = Field(default=8, ge=1)
    """Training tasks the pre-flight check runs (each group_size times)."""
    keep_best: bool = True
    """Keep the checkpoint of the best held-out evaluation (before training counts) and
    export it as model/, the last weights as model-last/."""
    window: int = Field(default=3, ge=1)
    """Steps in the train reward's rolling mean, and the steps whose median is the
    baseline of entropy, KL and length."""
    reward_drop: float = Field(default=0.2, gt=0)
    """Warn (collapse) when the train reward's rolling mean falls this far below its best."""
    success_drop: float = Field(default=0.15, gt=0)
    """Warn (collapse) when a held-out evaluation falls this far below the best one."""
    entropy_ratio: float = Field(default=0.25, gt=0, le=1)
    """Warn when the sampled tokens' entropy estimate falls below this times its start."""
    length_ratio: float = Field(default=0.5, gt=0, le=1)
    """Warn when sampled tokens per rollout fall below this times their start."""
    kl_ratio: float = Field(default=10.0, gt=1)
    """Warn when KL(behaviour || current) exceeds this times its start ..."""
    kl_floor: float = Field(default=0.05, ge=0)
    """... and this absolute value (KL is ~0 in a synchronous run with one mini-batch)."""
    plateau_steps: int = Field(default=10, ge=0)
    """Warn (content_plateau) when the train reward's rolling mean has not risen 0.05 above
    its earlier best for this many steps, sits below 0.8, and most failing rollouts made as
    many model calls as the successful ones: what RL could teach is taught, and the failures
    left are wrong content (0: off)."""
    rollback: bool = False
    """On a collapse (a train reward or held-out success drop), restore the best checkpoint
    and multiply the learning rate by `lr_factor`. A data-parallel run (several trainer
    ranks) cannot: it refuses to start with it on."""
    lr_factor: float = Field(default=0.5, gt=0, le=1)
    """Learning-rate multiplier applied at each rollback."""
    max_rollbacks: int = Field(default=2, ge=0)
    """Rollbacks at most per run; later collapses are only warned about."""
    max_reward_errors: int = Field(default=3, ge=1)
    """The run stops, showing the traceback, once this many rollouts' reward function
    raised: a bug in the reward code, never a reward of 0 (each such rollout is kept in the
    store, marked, and never trained on)."""


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
    """Task file (JSONL), one task a line: {"id": "t1", "input": {...}, "answer": ...,
    "split": "train"}. `input` is what the agent receives; `answer` (optional) only the
    reward function sees; `split` is "train" (trained on, the default) or "eval" (held out)."""
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
    tool_parser: ToolParser | None = None
    """The tool-call format of `model`'s replies (hermes, qwen3_coder, llama3, mistral), for
    every role that sets none; default: read off each role's chat template."""
    thinking: Thinking | None = None
    """Reasoning markers [start, end] of `model`'s replies, for every role that sets none;
    default: `<think>`/`</think>` when each role's chat template knows them."""
    pipeline: PipelineConfig = PipelineConfig()
    """Scheduling."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Credit assignment."""
    curation: CurationConfig = CurationConfig()
    """Data curation: dynamic sampling, replay, adaptive group size, conditional advantage
    (each off by default)."""
    trainer: TrainerConfig = TrainerConfig(
        lr=3e-4, minibatches=2, warmup_steps=5, schedule="cosine"
    )
    """Policy update. Run defaults (docs/recipes.md has the measurements): lr 3e-4 with 5
    warmup steps and cosine decay to 10% over the run (the end settles instead of
    drifting), two PPO mini-batches per step (the second makes the clip bite)."""
    runner: RunnerConfig = RunnerConfig()
    """How rollouts are run."""
    engine: EngineConfig = EngineConfig()
    """How the policy is served."""
    guard: GuardConfig = GuardConfig()
    """Guard rails: pre-flight check, best checkpoint, collapse detection, rollback."""
    gateway: GatewayConfig = GatewayConfig()
    """Model names the agent's clients hard-code, mapped to roles."""
    device: str = Field(default="cpu")
    """torch device of the trainer ("cpu", "cuda", "cuda:1"); the engine's too unless
    engine.device is given: one switch moves the run to a GPU."""
    cluster: ClusterConfig = ClusterConfig()
    """Past one machine: Ray places the runners and trainer ranks (`--cluster.address`);
    off by default, and Ray is then never imported."""
    assets: AssetsConfig = AssetsConfig()
    """Assets in training: `--assets.curriculum '{"name": "format", "start": 1.0, "end":
    0.0, "steps": 20}'` gives each rollout the asset (from the run's store) with a
    probability falling over the steps; held-out evaluations run without it."""

    @model_validator(mode="before")
    @classmethod
    def _sections_keep_run_defaults(cls, data: Any) -> Any:
        # `[trainer] lr = 1e-4` (or `--trainer.lr`) arrives as {"trainer": {"lr": ...}}:
        # the section's other fields keep the run's defaults above, not the section
        # class's own.
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, field in cls.model_fields.items():
            if isinstance(field.default, BaseModel) and isinstance(out.get(name), dict):
                out[name] = field.default.model_dump(exclude_unset=True) | out[name]
        return out

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
        return policy_specs(
            self.roles, self.model_name, self.model, self.trainer.lora, self.reply_format()
        )

    def reply_format(self) -> ReplyFormat:
        """How the gateway reads replies of roles that set no format of their own."""
        return ReplyFormat(self.tool_parser, self.thinking)

    def check(self) -> None:
        """Clear errors for missing essentials (they may come from a TOML file or flags)."""
        if not self.roles and not self.model:
            raise ValueError("train needs --model (or `model = ...`, or [roles.*] with models)")
        for field in ("agent", "tasks"):
            if not getattr(self, field):
                raise ValueError(f"train needs --{field} (or `{field} = ...` in the config file)")
        check_local_models(self.policies(), bool(self.roles))
        top_model(self.model_name, self.roles, named=True)
        if self.guard.rollback and self.cluster.trainer_ranks > 1:
            raise ValueError(
                "guard.rollback is not possible in a data-parallel run (cluster.trainer_ranks "
                f"= {self.cluster.trainer_ranks}): its trainer ranks take no optimizer changes "
                "mid-run; turn one of them off"
            )
        unknown = sorted(set(self.algorithm.align) - set(self.roles or [self.model_name]))
        if unknown:
            raise ValueError(
                f"algorithm.align names {unknown}, not roles of this run "
                f"{sorted(self.roles or [self.model_name])}"
            )
