"""The commands' typed configs: every field documented and settable as --field (nested ones
as --section.field). Torch-free: `tracerl --help` reads every one of them.

`train` and `demo` take TrainConfig itself (with a file and --resume, or the demo's
defaults); `serve` and `eval` share ServingConfig, what a gateway serves.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import CliPositionalArg, CliSubCommand

from tracerl.engines.config import EngineConfig
from tracerl.limits import Limits
from tracerl.pipeline.config import TrainConfig
from tracerl.roles import (
    GatewayConfig,
    PolicySpec,
    ReplyFormat,
    RoleConfig,
    Thinking,
    ToolParser,
    check_local_models,
    resolve_roles,
    top_model,
)
from tracerl.runner import RunnerConfig
from tracerl.trainer.config import LoraSettings

__all__ = [
    "Command",
    "EvalCommand",
    "RunnerCommand",
    "ServeCommand",
    "ServingConfig",
    "SftCommand",
    "TracesCommand",
    "TracesList",
    "TracesPrune",
    "TracesShow",
    "TrainCommand",
    "config_errors",
]


def config_errors(e: ValidationError) -> str:
    """Each error as 'section.key: what is wrong', so an unknown key is named."""
    return "; ".join(
        f"{'.'.join(str(part) for part in err['loc'])}: {err['msg']}" for err in e.errors()
    )


class Command(BaseModel):
    """A command's config: documented fields, unknown keys refused by name."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")


class TrainCommand(TrainConfig):
    """Train any agent on any task file with RL through the gateway: evaluate, train,
    evaluate. Fields come from an optional TOML file, then from flags."""

    config: CliPositionalArg[str] = ""
    """TOML file with any of the fields below (sections for nested ones)."""
    resume: str | None = None
    """Continue the run in this directory (runs/<name>) from its last checkpoint."""


class ServingConfig(Command):
    """What a gateway serves: one local model, or each role's policy."""

    model: str = ""
    """Local HF model directory to serve (the default of every role without its own)."""
    roles: dict[str, RoleConfig] = {}
    """Agent systems with several roles: each role's model dir, shared weights or url, as in
    `tracerl train` (JSON, e.g. '{"planner": {"model": "m/p"}, "executor": {"share":
    "planner"}}'): one engine per policy, remote roles forwarded."""
    tool_parser: ToolParser | None = None
    """The tool-call format of `model`'s replies (hermes, qwen3_coder, llama3, mistral), for
    every role that sets none; default: read off each role's chat template."""
    thinking: Thinking | None = None
    """Reasoning markers [start, end] of `model`'s replies, for every role that sets none;
    default: `<think>`/`</think>` when each role's chat template knows them."""
    model_name: str = "policy"
    """The model name the agent is told to use (the role); with `roles`, default: the first."""
    engine: EngineConfig = EngineConfig()
    """How the model is served."""
    gateway: GatewayConfig = GatewayConfig()
    """Model names clients hard-code, mapped to roles."""

    def policies(self, command: str) -> list[PolicySpec]:
        """The policies to serve: `model` as `model_name`, or each role of `roles`
        (ValueError saying what is wrong: nothing to serve, a bad mapping, a missing dir)."""
        if not self.model and not self.roles:
            raise ValueError(f"{command} needs --model DIR (or --roles for several roles)")
        roles = self.roles or {self.model_name: RoleConfig()}
        specs = resolve_roles(roles, self.model, reply=self.reply_format())
        check_local_models(specs, bool(self.roles))
        return specs

    def reply_format(self) -> ReplyFormat:
        """How the gateway reads replies of roles that set no format of their own."""
        return ReplyFormat(self.tool_parser, self.thinking)

    def top_model(self) -> str:
        """The model name the top agent is told (ValueError if no role serves it)."""
        return top_model(self.model_name, self.roles, "model_name" in self.model_fields_set)


class ServeCommand(ServingConfig):
    """Run the store and the gateway as their own process, for runners elsewhere."""

    store: str = "runs/serve/traces.db"
    """The store: a SQLite file, or a `postgresql://` URL (many gateways and runners on many
    hosts)."""
    host: str = "127.0.0.1"
    """Interface to listen on; beyond loopback only with keys."""
    port: int = 8000
    """Port to listen on."""
    keys_file: str | None = None
    """TOML keys file (`admin = "..."`, `[runners]` id = "key"), read beside the
    TRACERL_ADMIN_KEY / TRACERL_RUNNER_KEYS environment variables. Keys are never flags:
    a command line is visible to every user of the machine. No keys: every route open."""
    limits: Limits = Limits()
    """Bounds on one request: body size and arrival time, n, max_tokens, calls in flight
    per rollout, the lease a runner may hold."""


class EvalCommand(ServingConfig):
    """Run N rollouts of any agent through the gateway and report success and traces."""

    agent: CliPositionalArg[str]
    """The agent: 'file.py:function', 'module:function', or 'cmd:<command line>'."""
    tasks: str
    """Task file (JSONL: one {"id", "input", "answer", "split"} per line)."""
    reward: str | None = None
    """Reward function 'file.py:function' called as f(task, answer); optional when the
    agent returns or emits its own reward."""
    split: str | None = None
    """Only tasks of this split (default: all)."""
    repeats: int = Field(default=1, ge=1)
    """Rollouts per task."""
    name: str = "eval"
    """Run name: outputs go to <runs>/<name>/."""
    runs: str = "runs"
    """Folder holding runs."""
    runner: RunnerConfig = RunnerConfig()
    """How rollouts are run."""


class RunnerCommand(Command):
    """Run a pool of workers that claim rollouts from a remote store and run the agent."""

    agent: CliPositionalArg[str]
    """The agent: 'file.py:function', 'module:function', or 'cmd:<command line>'."""
    url: str
    """Base URL of `tracerl serve` (store API at <url>/store, gateway at <url>)."""
    reward: str | None = None
    """Reward function 'file.py:function'."""
    model_name: str = "policy"
    """The model name the agent is told to use (a role `tracerl serve` serves)."""
    until_idle: bool = True
    """Exit once nothing is queued or running."""
    runner: RunnerConfig = RunnerConfig()
    """How rollouts are run."""


class SftCommand(Command):
    """Supervised warm start of a local model (or a new tiny one) from demonstrations."""

    demos: str | None = None
    """Demonstrations JSONL, each line OpenAI chat ({"messages": [...], "tools": [...]}; other
    keys such as "id" are ignored) or an ADP trajectory (`tracerl export`; with its token ids
    these are trained on as they are, and need --base)."""
    from_traces: str | None = Field(default=None, alias="from-traces")
    """Train on recorded traces instead: a store file or run dir. Each rollout's calls are
    merged per role into rows as RL does; the loss falls on the sampled ids only, never
    re-tokenized. Needs --base (the tokenizer that made the ids)."""
    filter: str | None = None
    """With --from-traces: which rollouts and calls, e.g. 'reward >= 1 and role == executor'
    (fields reward, noise, status, split, task, role, version; tracerl/export/filter.py).
    Default: the rollouts that succeeded (status succeeded, reward at or above
    --success_threshold), so a failure is never imitated unless asked for
    ('status != "queued"' takes every one)."""
    success_threshold: float = 1.0
    """With --from-traces and no --filter: the reward at or above which a rollout counts as
    a success (a run's own threshold)."""
    out: str
    """Output HF model directory."""
    base: str | None = None
    """Local HF model dir to start from (one you trained, one `tracerl models get` built, or
    any Hugging Face model on disk). Left out: a new tiny model is built, its tokenizer
    trained on the demos' text, and saved beside the output as <out>-base."""
    steps: int = Field(default=1000, ge=1)
    """Optimizer steps to train; with --skill_target the cap, a safety limit only: the
    schedule is constant after warm-up then, so a larger cap changes nothing before it."""
    batch_size: int = Field(default=16, ge=1)
    """Conversations per optimizer step."""
    lr: float = Field(default=2e-3, gt=0)
    """Peak learning rate: 2e-3 suits the new tiny model; a pretrained model wants about 1e-5
    for full fine-tuning."""
    stop_loss: float | None = None
    """Stop early once the running loss is below this (unset: never)."""
    seed: int = 0
    """Seed of the data order and of the held-out share."""
    recipe: Literal["plain", "skill-then-habit"] = "plain"
    """'plain': one SFT. 'skill-then-habit': the skill on the clean demos into <out>-skill,
    then a short gentle SFT into <out> where habit_rate of the demos are made to skip their
    tools and answer a corrupted guess (a weak start RL can fix; docs/recipes.md)."""
    habit_rate: float = Field(default=0.65, ge=0.0, le=1.0)
    """skill-then-habit: share of the habit stage's demos that skip the tools."""
    habit_steps: int = Field(default=150, ge=1)
    """skill-then-habit: SFT steps of the habit stage."""
    habit_lr: float = Field(default=2e-4, gt=0)
    """skill-then-habit: peak learning rate of the habit stage."""
    skill_target: float | None = Field(default=None, gt=0, le=1)
    """Train until the held-out score reaches this (the skill stage of skill-then-habit, or
    the one SFT of plain); --steps becomes the cap. The score (--target_metric) is exact
    match by default: the share of held-out demos whose every assistant token is the
    model's top choice given the demo before it, so greedy decoding copies every tool call
    and the final answer. It stays near 0 until the model learns to copy (a few hundred
    steps for the calculator), then rises within a few checks."""
    target_metric: Literal["exact", "sampled"] = "exact"
    """What --skill_target is about: 'exact' (greedy decoding copies a demo whole) or
    'sampled' (the mean probability that sampling at temperature 1 does; stricter)."""
    holdout: float = Field(default=0.1, gt=0, lt=1)
    """Share of the demos held out (chosen by --seed) and scored every --eval_every steps,
    the scores printed and kept in <out>/sft.json: always with --skill_target; without one,
    only when this flag is given (every step is then trained)."""
    eval_every: int = Field(default=50, ge=1)
    """With a holdout: steps between held-out checks."""
    cooldown: int = Field(default=0, ge=0)
    """With --skill_target: once the target is reached, steps that decay the learning rate
    linearly to 0 before a last check (the demo uses 200; 0: stop at the check)."""
    lora: LoraSettings | None = None
    """Train a LoRA adapter (peft) instead of all weights, e.g. '{"r": 16}'; the output is
    still a plain model dir (the adapter merged in; the adapter itself in <out>/adapter)."""
    bf16: Literal["auto"] | bool = "auto"
    """bf16 autocast: auto (only where the hardware computes bf16 natively: a CUDA GPU that
    supports it, a CPU with AVX512-BF16 or AMX; fp32 elsewhere), true or false."""
    device: str = "cpu"
    """Where to train: cpu, cuda, cuda:1, ..."""
    threads: int | None = Field(default=None, ge=1)
    """torch CPU threads (unset: torch's default, the machine's cores)."""
    checkpoint_every: int = Field(default=100, ge=0)
    """Steps between checkpoints (in <out>/.sft-checkpoint; 0: none)."""
    resume: bool = False
    """Continue an interrupted run from its last checkpoint (same flags); stages already
    finished are kept."""


class TracesShow(Command):
    """Print one rollout: every model call with its messages, tokens, policy version,
    latency, and the reward."""

    rollout_id: CliPositionalArg[str]
    """The rollout to show."""
    store: str | None = None
    """Store file or URL (default: the last run's)."""


class TracesList(Command):
    """List recent rollouts."""

    store: str | None = None
    """Store file or URL (default: the last run's)."""
    limit: int = 20
    """How many."""


class TracesPrune(Command):
    """Shrink a store: delete old finished rollouts with their spans and rewards, then
    VACUUM. Rollouts queued or running, and those a --keep_run run still needs, stay."""

    store: str | None = None
    """Store file or postgresql:// URL (default: the last run's)."""
    keep: int | None = Field(default=None, ge=0)
    """Keep the N most recently finished rollouts."""
    keep_days: float | None = Field(default=None, ge=0)
    """Keep rollouts finished within the last D days."""
    keep_run: list[str] = []
    """Run directory (runs/<name>) whose pending groups and replay buffer are kept, as its
    latest checkpoint names them; repeatable. Alone, every other finished rollout goes."""


class TracesCommand(Command):
    """Read recorded traces, or prune them."""

    show: CliSubCommand[TracesShow]
    """Print one rollout."""
    list: CliSubCommand[TracesList]
    """List recent rollouts."""
    prune: CliSubCommand[TracesPrune]
    """Delete old finished rollouts a run no longer needs."""
