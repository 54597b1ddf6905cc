"""The OpenAI wire format: request records, message normalisation, tool-call parsing.

Requests are validated into typed records here so the gateway's handlers see only
checked values; every validation failure becomes an OpenAI-style 4xx error upstream.
Messages are normalised into one canonical form (plain-text content, tool-call arguments
as dicts) so that chat templates render them and token-in/token-out can compare them.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator

from tracerl.gateway import toolcalls
from tracerl.gateway.toolcalls import ParsedReply

Message = dict[str, JsonValue]
"""A canonical chat message: role, content (str), optional tool_calls / tool_call_id / name."""

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_OBJECT_SCHEMA: dict[str, JsonValue] = {
    "type": {"const": "object"},
    "properties": {"type": "object"},
}
"""What a function's `parameters` may say of its own `type` and `properties` (the API
document says it too: FunctionSpec._schema_ok checks exactly this)."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per position a call may ask for (OpenAI's bound)."""


StopList = Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)]
"""Stop strings as a list: at most 4, none empty."""


class FunctionSpec(BaseModel):
    """A function the model may call (the `function` part of an OpenAI tool)."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=_TOOL_NAME.pattern)
    """Function name: letters, digits, '_', '.', '-', at most 64 characters."""
    description: str | None = None
    """What it does, for the model."""
    parameters: dict[str, JsonValue] = Field(
        default_factory=dict, json_schema_extra={"properties": _OBJECT_SCHEMA}
    )
    """JSON Schema of the arguments; must describe an object."""

    @field_validator("parameters")
    @classmethod
    def _schema_ok(cls, schema: dict[str, JsonValue]) -> dict[str, JsonValue]:
        if schema and schema.get("type", "object") != "object":
            raise ValueError("function parameters must be a JSON Schema of type 'object'")
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise ValueError("function parameters 'properties' must be an object")
        return schema


class ToolSpec(BaseModel):
    """One entry of the request's `tools` list."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    """Only function tools exist in the chat API."""
    function: FunctionSpec
    """The function."""


class ToolName(BaseModel):
    """The `function` of a named tool choice."""

    name: str
    """The function that must be called."""


class NamedToolChoice(BaseModel):
    """tool_choice {"type": "function", "function": {"name": ...}}."""

    type: Literal["function"]
    """Always "function"."""
    function: ToolName
    """Which one."""


class JsonSchemaFormat(BaseModel):
    """The `json_schema` of a response_format."""

    model_config = ConfigDict(extra="allow")

    name: str = "response"
    """A label for the schema."""
    schema_: dict[str, JsonValue] = Field(default_factory=dict, alias="schema")
    """The JSON Schema the reply must satisfy."""
    strict: bool | None = None
    """Accepted; the schema is always enforced where decoding is constrained."""


class ResponseFormat(BaseModel):
    """response_format: text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    """What the reply must be."""
    json_schema: JsonSchemaFormat | None = None
    """The schema, for type json_schema (ChatRequest.rules checks it is given)."""


class ChatRequest(BaseModel):
    """A /v1/chat/completions request; unknown OpenAI fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str
    """Served model name; in tracerl also the role the call belongs to."""
    messages: list[dict[str, Any]] = Field(min_length=1)
    """The conversation so far, in OpenAI format."""
    tools: list[ToolSpec] | None = None
    """Functions the model may call."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Upper bound on sampled tokens."""
    max_completion_tokens: int | None = Field(default=None, ge=1)
    """Newer name of max_tokens; wins when both are given."""
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    """Sampling temperature."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass."""
    n: int = Field(default=1, ge=1, le=16)
    """Number of choices."""
    stop: str | StopList | None = None
    """Up to 4 stop strings."""
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    """Sampler seed; choice i uses seed + i (64 bits, what a torch generator takes)."""
    logprobs: bool = False
    """Return the sampled tokens' log-probs."""
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """With logprobs, the most likely tokens returned at each position, at most 20."""
    stream: bool = False
    """Answer as server-sent events."""
    stream_options: dict[str, JsonValue] | None = None
    """{"include_usage": true} adds a final usage chunk."""
    tool_choice: (
        Literal["none", "auto", "required"] | NamedToolChoice | dict[str, JsonValue] | None
    ) = Field(default=None, union_mode="left_to_right")
    """"required" or a named function forces a tool call (enforced by engines that
    constrain decoding: the transformers and vLLM ones); "none", "auto" and choices of other types
    (allowed_tools, custom) constrain nothing."""
    parallel_tool_calls: bool | None = None
    """False: a forced tool call is exactly one call (default: one or more)."""
    response_format: ResponseFormat | None = None
    """{"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}:
    the reply is valid JSON (of that schema) where decoding is constrained."""

    def rules(self) -> tuple[str, str] | None:
        """(param, why) of the first rule between fields this request breaks, or None.

        Rules the API document cannot state (a named tool among the tools given). The
        gateway checks them once it knows which model answers (an unknown model is a 404
        first), so a request the document allows is refused only for what it is about."""
        names = {t.function.name for t in self.tools or []}
        if isinstance(self.tool_choice, dict) and self.tool_choice.get("type") == "function":
            return "tool_choice", "tool_choice of type 'function' needs function.name"
        if self.tool_choice == "required" and not names:
            return "tool_choice", "tool_choice 'required' needs tools"
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in names:
                return "tool_choice", f"tool_choice names {name!r}, which is not among the tools"
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
            return "response_format", "response_format json_schema needs a json_schema"
        return None

    def stop_list(self) -> list[str]:
        """Stop strings as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_limit(self) -> int | None:
        """max_completion_tokens, else max_tokens."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(BaseModel):
    """A /v1/completions request (raw text or token ids in, text out)."""

    model_config = ConfigDict(extra="allow")

    model: str
    """Served model name (role)."""
    prompt: str | list[int]
    """Text, or token ids used verbatim."""
    max_tokens: int = Field(default=16, ge=1)
    """Upper bound on sampled tokens."""
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    """Sampling temperature."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass."""
    n: int = Field(default=1, ge=1, le=16)
    """Number of choices."""
    stop: str | StopList | None = None
    """Up to 4 stop strings."""
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    """Sampler seed (64 bits, what a torch generator takes)."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """Return the sampled tokens' log-probs, and this many most likely tokens at each
    position (0: none), at most 20."""
    echo: bool = Field(default=False, json_schema_extra={"enum": [False]})
    """Not supported (rejected when true)."""
    stream: bool = False
    """Answer as server-sent events."""
    stream_options: dict[str, JsonValue] | None = None
    """{"include_usage": true} adds a final usage chunk."""

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    def stop_list(self) -> list[str]:
        """Stop strings as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _text(content: Any) -> str:
    """OpenAI content (string, None, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError("only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ValueError("message content must be a string or a list of text parts")


def _arguments(raw: Any) -> dict[str, JsonValue]:
    """Tool-call arguments as a dict (the wire carries a JSON string)."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call arguments are not valid JSON: {e.msg}") from e
        if isinstance(value, dict):
            return value
    raise ValueError("tool call arguments must be a JSON object")


def normalize_message(raw: dict[str, Any]) -> Message:
    """One request message in canonical form; raises ValueError on malformed input."""
    if not isinstance(raw, dict):
        raise ValueError("each message must be an object")
    role = raw.get("role")
    if role not in _ROLES:
        raise ValueError(f"invalid message role {role!r}")
    msg: Message = {"role": "system" if role == "developer" else role}
    msg["content"] = _text(raw.get("content"))
    if role == "assistant" and raw.get("tool_calls"):
        calls: list[JsonValue] = []
        for call in raw["tool_calls"]:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError("each tool call needs a function with a name")
            calls.append(
                {
                    "id": str(call.get("id", "")),
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"))},
                }
            )
        msg["tool_calls"] = calls
    if role == "tool":
        msg["tool_call_id"] = str(raw.get("tool_call_id", ""))
    if isinstance(raw.get("name"), str):
        msg["name"] = raw["name"]
    return msg


def same_turn(returned: Message, echoed: Message) -> bool:
    """Whether the agent sent back the assistant message we returned, unchanged.

    Tool-call ids are ignored (some clients re-number them); content and each call's name
    and arguments must match exactly.
    """
    if echoed.get("role") != "assistant" or echoed.get("content") != returned.get("content"):
        return False
    mine = returned.get("tool_calls") or []
    theirs = echoed.get("tool_calls") or []
    assert isinstance(mine, list) and isinstance(theirs, list)
    if len(mine) != len(theirs):
        return False
    return all(
        isinstance(a, dict) and isinstance(b, dict) and a["function"] == b["function"]
        for a, b in zip(mine, theirs, strict=True)
    )


def parse_reply(text: str, tools_given: bool) -> ParsedReply:
    """Split Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks out of
    text (the tiny model's convention); served models pick their own format (toolcalls)."""
    return toolcalls.parse_reply(text, [] if tools_given else None)


def wire_message(reply: ParsedReply, call_ids: list[str]) -> dict[str, Any]:
    """The assistant message as OpenAI returns it (arguments as JSON strings)."""
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.reasoning:
        msg["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        msg["tool_calls"] = [
            {
                "id": cid,
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for cid, c in zip(call_ids, reply.tool_calls, strict=True)
        ]
    return msg


def canonical_reply(reply: ParsedReply, call_ids: list[str]) -> Message:
    """The assistant message in canonical form, as the next request should echo it."""
    msg: Message = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        msg["tool_calls"] = [
            {"id": cid, "type": "function", "function": c}
            for cid, c in zip(call_ids, reply.tool_calls, strict=True)
        ]
    return msg
