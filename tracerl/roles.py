"""Roles -> policies: which `model` names agents ask for, and which weights answer them.

A role is the model name an agent's call names ("planner", "executor"). A role with local
weights of its own is a policy (a trainer and an engine); a sharing role plays another
role's policy; a frozen role is served and recorded, never trained; a role served by a URL
elsewhere is forwarded by the gateway and recorded as text. Torch-free: configs use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from tracerl.assets.config import AssetUse
from tracerl.trainer.config import LoraSettings

if TYPE_CHECKING:
    from tracerl.gateway.remote import RemoteModel

__all__ = [
    "GatewayConfig",
    "PolicySpec",
    "ReplyFormat",
    "RoleConfig",
    "Thinking",
    "ToolParser",
    "check_local_models",
    "policy_specs",
    "remote_roles",
    "resolve_roles",
    "top_model",
]


ToolParser = Literal["hermes", "qwen3_coder", "llama3", "mistral"]
"""A tool-call format the gateway parses (tracerl.gateway.toolcalls.FORMATS)."""


def _markers(pair: tuple[str, str]) -> tuple[str, str]:
    start, end = pair
    if not start or not end or start == end:
        raise ValueError(f"thinking {pair!r}: expected two different non-empty markers")
    return pair


Thinking = Annotated[tuple[str, str], AfterValidator(_markers)]
"""Reasoning markers (start, end), e.g. ["<think>", "</think>"]."""


@dataclass(frozen=True)
class ReplyFormat:
    """How the gateway reads one role's replies. Parsing only shapes the response the agent
    gets; the span keeps the model's own token ids."""

    tool_parser: ToolParser | None = None
    """Its tool-call format; None: read off the chat template."""
    thinking: tuple[str, str] | None = None
    """Its reasoning markers; None: `<think>`/`</think>` when the chat template knows them."""


class RoleConfig(BaseModel):
    """How one role (a `model` name agents ask for) is served and trained."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    model: str | None = None
    """Its own local HF model dir; default: the run's `model`."""
    share: str | None = None
    """Play this other role's policy: the same weights, trained on both roles' rows (one
    backbone, several roles)."""
    frozen: bool = False
    """Served by the local engine and recorded, never trained."""
    lora: LoraSettings | None = None
    """A LoRA adapter of its own on `model` (saved as a standard peft adapter); default:
    the run's trainer.lora."""
    url: str | None = None
    """Served by this OpenAI-compatible server instead (base URL up to /v1): frozen, its
    calls recorded as text (no tokens), never trained."""
    remote_model: str | None = None
    """With `url`: the model name that server knows; default: the role's name."""
    api_key_env: str | None = None
    """With `url`: the environment variable holding its API key (sent as a bearer token)."""
    tokenizer: str | None = None
    """With `url`: a local model dir whose tokenizer and chat template record this role's
    calls as token ids too (the prompt as that template renders it, the reply's text as the
    completion), so `tracerl sft --from-traces --base <dir>` trains a student on a remote
    teacher's calls; unset: recorded as text only."""
    tool_parser: ToolParser | None = None
    """The tool-call format its replies are parsed in (hermes, qwen3_coder, llama3,
    mistral); a role playing another's policy keeps its own; with `url`, how `tokenizer`'s
    template writes calls. Default: the run's tool_parser, else read off the chat template
    (Hermes when it gives no sign)."""
    thinking: Thinking | None = None
    """Its reasoning markers [start, end], split off the reply as `reasoning_content`.
    Default: the run's thinking, else `<think>`/`</think>` when the chat template knows
    them."""

    @model_validator(mode="after")
    def _remote_alone(self) -> RoleConfig:
        if self.url is None:
            if self.remote_model or self.api_key_env or self.tokenizer:
                raise ValueError("remote_model, api_key_env and tokenizer need a url")
            return self
        if (self.tool_parser or self.thinking) and not self.tokenizer:
            raise ValueError(
                "a url role parses nothing itself: tool_parser and thinking need a tokenizer"
            )
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url {self.url!r}: expected http(s)://host[:port]/v1")
        if self.model or self.share or self.lora:
            raise ValueError("a role served by a url has no local model, share or lora")
        return self

    def reply_format(self, default: ReplyFormat) -> ReplyFormat:
        """Its own tool_parser and thinking, else `default`'s (the run's)."""
        return ReplyFormat(
            self.tool_parser or default.tool_parser, self.thinking or default.thinking
        )


@dataclass
class PolicySpec:
    """A policy resolved from the roles: its name, weights, roles, and whether it trains."""

    name: str
    model: str
    roles: list[str]
    frozen: bool
    lora: LoraSettings | None
    formats: dict[str, ReplyFormat] = field(default_factory=dict)
    """How the gateway reads each of its roles' replies (a sharing role's are its own)."""


def resolve_roles(
    roles: dict[str, RoleConfig],
    model: str,
    lora: LoraSettings | None = None,
    reply: ReplyFormat = ReplyFormat(),
) -> list[PolicySpec]:
    """Roles -> policies: a role with local weights of its own is a policy named after it
    (its model dir, else `model`); a sharing role joins its target's policy; a role served
    by a url is none. `reply` is the run's reply format, for roles that set none. Clear
    errors for a bad mapping."""
    specs: dict[str, PolicySpec] = {}
    for role, rc in roles.items():
        if rc.share is None and rc.url is None:
            own = rc.lora or lora
            specs[role] = PolicySpec(role, rc.model or model, [role], rc.frozen, own)
            specs[role].formats[role] = rc.reply_format(reply)
    for role, rc in roles.items():
        if rc.share is None:
            continue
        if rc.share not in specs:
            raise ValueError(
                f"role {role!r} shares {rc.share!r}, which is not a role with local weights "
                "of its own"
            )
        if rc.model or rc.lora or rc.frozen:
            raise ValueError(
                f"role {role!r} shares {rc.share!r}'s weights; set model, lora or frozen "
                f"on {rc.share!r} instead"
            )
        specs[rc.share].roles.append(role)
        specs[rc.share].formats[role] = rc.reply_format(reply)
    return list(specs.values())


def policy_specs(
    roles: dict[str, RoleConfig],
    model_name: str,
    model: str,
    lora: LoraSettings | None,
    reply: ReplyFormat = ReplyFormat(),
) -> list[PolicySpec]:
    """A run's policies (one, `model_name` from `model`, when `roles` is empty)."""
    specs = resolve_roles(roles or {model_name: RoleConfig()}, model, lora, reply)
    if all(spec.frozen for spec in specs):
        raise ValueError("every role is frozen: there is nothing to train")
    return specs


def remote_roles(
    roles: dict[str, RoleConfig], reply: ReplyFormat = ReplyFormat()
) -> dict[str, RemoteModel]:
    """The roles served by OpenAI-compatible URLs elsewhere (frozen, recorded as text, and as
    a local tokenizer's ids, read back in `reply` unless they set their own, when they name
    one)."""
    from tracerl.gateway.remote import RemoteModel

    out = {}
    for role, rc in roles.items():
        if rc.url is None:
            continue
        fmt = rc.reply_format(reply) if rc.tokenizer else ReplyFormat()
        out[role] = RemoteModel(
            role, rc.url, rc.remote_model or role, rc.api_key_env, rc.tokenizer, fmt
        )
    return out


def check_local_models(specs: list[PolicySpec], roles: bool) -> None:
    """Every policy's weights are a local directory (ValueError naming the role, or
    --model when there are no `roles`)."""
    for spec in specs:
        if not spec.model or not Path(spec.model).is_dir():
            where = f"role {spec.name!r}'s model" if roles else "--model"
            raise ValueError(f"{where} {spec.model!r}: not a local model directory")


def top_model(model_name: str, roles: dict[str, RoleConfig], named: bool) -> str:
    """The model name the runner hands the top agent: `model_name`, or with roles and no
    `model_name` given (`named` false), the first role. A name no role serves is an error
    here rather than a 404 in every rollout."""
    if not roles or model_name in roles:
        return model_name
    if not named:
        return next(iter(roles))
    raise ValueError(
        f"model_name {model_name!r} is not one of the roles {sorted(roles)}: set model_name "
        "to the role the top agent calls"
    )


class GatewayConfig(BaseModel):
    """The gateway's own settings (in `tracerl serve`, `eval` and `train`: --gateway.*)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", frozen=True)

    model_aliases: dict[str, str] = {}
    """Model names clients send -> the role that answers them, for agents that hard-code a
    name (e.g. '{"claude-sonnet-4-5": "executor", "gpt-5": "planner"}'). Spans record the
    role; replies carry the name asked for."""
    default_model: str | None = None
    """The role answering any other name it does not serve; unset: unknown names get 404."""
    record: Literal["all", "rollouts"] = "all"
    """Which calls are recorded: "all" records a call to plain /v1 that names no rollout
    under a session (X-Tracerl-Session, a client's session header, metadata, or its API
    key); "rollouts" refuses such calls with a 400 naming X-Tracerl-Rollout."""
    session_idle_s: float = Field(default=300.0, gt=0)
    """Seconds without a call after which a session's rollout is finished (succeeded)."""
    assets: dict[str, AssetUse] = {}
    """Assets (named, versioned texts in the store: `tracerl assets put`) added to the
    system message of every chat call, before templating, e.g. '{"format": {"mode":
    "append", "roles": ["policy"]}}' (version: a pinned one; default the current one, per
    rollout attempt). A rollout's own assets override the versions; spans record them."""
    unassisted: list[str] = []
    """Assets whose calls also record, on their spans, the prompt's ids without any asset:
    the context an asset curriculum distills into (`tracerl train` adds its curriculum's
    asset when `assets.curriculum.distill` is on). Costs a second render per such call."""
