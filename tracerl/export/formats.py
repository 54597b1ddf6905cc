"""Trace rows <-> files: Agent Data Protocol trajectories and OpenAI fine-tuning lines.

ADP (the agent data protocol, an interlingua between agent datasets) writes one trajectory
per row: `{"id", "content": [...], "details": {...}}`, where `content` alternates actions
and observations. The model's messages are actions (`message_action` for text,
`api_action` per tool call, the message's text as the first call's `description`); user
turns and tool results are `text_observation`s (source "user" / "environment"). `details`
holds the task, rollout, role, reward and status, the system prompt and tools, and
`tracerl_tokens`: the row's exact input_ids and loss_mask, so ADP -> SFT trains on the
recorded ids (identical, whatever the tokenizer would do with the text).

OpenAI fine-tuning JSONL writes `{"messages": [...], "tools": [...]}` (plus "id",
"task_id", "reward" for bookkeeping, ignored by readers). It carries text only, so
`tracerl sft` re-renders it with the chat template. That reproduces the recorded ids only
when the gateway reused ids along the whole conversation (no prefix_break) and every
sampled completion is the tokenizer's own encoding of the reply as the template writes
it: a completion cut by max_tokens or a stop string, a reply whose tool-call JSON the
template re-serialises differently, or a non-canonical tokenization the model sampled
(e.g. "12" as "1", "2") each give other ids. Spans do not record the request's tools, so
the exporter is told them (`--tools`).

`read_training_file` reads either format, deciding per line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from tracerl.export.select import TraceRow
from tracerl.jsonl import read_objects
from tracerl.models.sft import Demo, EncodedDemo

__all__ = [
    "AdpTrajectory",
    "adp_line",
    "adp_to_messages",
    "conversation",
    "messages_to_adp",
    "openai_line",
    "read_training_file",
]

Message = dict[str, JsonValue]


class _Step(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class MessageAction(_Step):
    """The model says text to the user (a final answer, a question)."""

    class_: Literal["message_action"] = "message_action"
    """ADP's discriminator."""
    content: str
    """The text."""
    description: str | None = None
    """Reasoning shown with it, if any."""


class ApiAction(_Step):
    """The model calls a tool."""

    class_: Literal["api_action"] = "api_action"
    """ADP's discriminator."""
    function: str
    """The tool's name."""
    kwargs: dict[str, JsonValue]
    """Its arguments."""
    description: str | None = None
    """Text the model wrote with the call (the first call of a message carries it)."""
    id: str | None = None
    """The tool call's id, which the tool result's observation answers."""


class TextObservation(_Step):
    """What the agent is told: a user turn or a tool's result."""

    class_: Literal["text_observation"] = "text_observation"
    """ADP's discriminator."""
    content: str
    """The text."""
    source: Literal["user", "environment"]
    """A user turn, or the environment (a tool's result)."""
    name: str | None = None
    """For a tool result, the tool's name."""
    tool_call_id: str | None = None
    """For a tool result, the call it answers."""


Step = Annotated[MessageAction | ApiAction | TextObservation, Field(discriminator="class_")]


class AdpTrajectory(BaseModel):
    """One ADP trajectory: a conversation as actions and observations, with its details."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    """Unique id (rollout id, then the row's index within the rollout)."""
    content: list[Step]
    """Actions and observations, in order."""
    details: dict[str, JsonValue] = {}
    """Task, rollout, role, reward, status, system prompt, tools and `tracerl_tokens`."""


def _wire(message: Message) -> Message:
    """The message as OpenAI writes it: tool-call arguments as JSON text (the gateway
    records requests in canonical form, arguments parsed)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    out: list[JsonValue] = []
    for call in calls:
        assert isinstance(call, dict) and isinstance(call["function"], dict)
        args = call["function"].get("arguments")
        text = args if isinstance(args, str) else json.dumps(args)
        out.append({**call, "function": {**call["function"], "arguments": text}})
    return {**message, "tool_calls": out}


def conversation(row: TraceRow) -> list[Message]:
    """The row's whole conversation: its last call's request plus the reply it got."""
    last = row.spans[-1]
    reply = last.response.get("message")
    return [_wire(m) for m in [*last.messages, *([reply] if isinstance(reply, dict) else [])]]


def _assistant(m: Message) -> list[MessageAction | ApiAction]:
    text = str(m.get("content") or "")
    calls = m.get("tool_calls") or []
    assert isinstance(calls, list)
    if not calls:
        return [MessageAction(content=text)]
    out: list[MessageAction | ApiAction] = []
    for k, call in enumerate(calls):
        assert isinstance(call, dict) and isinstance(call["function"], dict)
        fn = call["function"]
        args = fn.get("arguments") or {}
        kwargs = json.loads(args) if isinstance(args, str) else args
        if not isinstance(kwargs, dict):
            raise ValueError(f"tool call arguments must be an object, got {args!r}")
        desc = (text or None) if k == 0 else None
        out.append(ApiAction(function=str(fn["name"]), kwargs=kwargs, description=desc,
                             id=str(call.get("id") or "") or None))  # fmt: skip
    return out


def messages_to_adp(messages: list[Message]) -> tuple[str | None, list[Step]]:
    """(system prompt, ADP content) of an OpenAI-format conversation."""
    system: str | None = None
    steps: list[Step] = []
    names: dict[str | None, str] = {}
    for m in messages:
        role, text = m.get("role"), str(m.get("content") or "")
        if role == "system":
            system = text
        elif role == "user":
            steps.append(TextObservation(content=text, source="user"))
        elif role == "assistant":
            actions = _assistant(m)
            names.update({a.id: a.function for a in actions if isinstance(a, ApiAction)})
            steps += actions
        elif role == "tool":
            cid = str(m.get("tool_call_id") or "") or None
            steps.append(TextObservation(content=text, source="environment",
                                         name=names.get(cid), tool_call_id=cid))  # fmt: skip
    return system, steps


def adp_to_messages(system: str | None, steps: list[Step]) -> list[Message]:
    """The OpenAI-format conversation of ADP content (consecutive calls: one message)."""
    out: list[Message] = [{"role": "system", "content": system}] if system is not None else []
    for s in steps:
        if isinstance(s, TextObservation):
            if s.source == "user":
                out.append({"role": "user", "content": s.content})
            else:
                out.append({"role": "tool", "tool_call_id": s.tool_call_id, "content": s.content})
        elif isinstance(s, MessageAction):
            out.append({"role": "assistant", "content": s.content})
        else:
            call: Message = {"id": s.id, "type": "function",
                    "function": {"name": s.function, "arguments": json.dumps(s.kwargs)}}  # fmt: skip
            last = out[-1] if out else {}
            if last.get("role") == "assistant" and s.description is None and "tool_calls" in last:
                calls = last["tool_calls"]
                assert isinstance(calls, list)
                calls.append(call)
            else:
                out.append({"role": "assistant", "content": s.description, "tool_calls": [call]})
    return out


def _details(row: TraceRow, tools: list[Message]) -> dict[str, JsonValue]:
    return {
        "task_id": row.task.id,
        "split": row.task.split,
        "rollout_id": row.rollout.id,
        "role": row.row.role,
        "reward": row.rollout.reward,
        "status": row.rollout.status.value,
        "noise": row.noise,
        "tools": list(tools),
    }


def adp_line(row: TraceRow, index: int, tools: list[Message]) -> str:
    """The row as one ADP trajectory (JSON text), its exact ids in details.tracerl_tokens."""
    system, steps = messages_to_adp(conversation(row))
    tokens: dict[str, JsonValue] = {
        "input_ids": list(row.row.input_ids),
        "loss_mask": list(row.row.loss_mask),
    }
    details = {**_details(row, tools), "system": system, "tracerl_tokens": tokens}
    traj = AdpTrajectory(id=f"{row.rollout.id}-{index}", content=steps, details=details)
    return traj.model_dump_json(exclude_none=True)


def openai_line(row: TraceRow, index: int, tools: list[Message]) -> str:
    """The row as one OpenAI fine-tuning line (JSON text)."""
    line = {"messages": conversation(row), "tools": tools, "id": f"{row.rollout.id}-{index}",
            "task_id": row.task.id, "reward": row.rollout.reward}  # fmt: skip
    return json.dumps(line)


def _from_adp(raw: dict) -> Demo | EncodedDemo:
    traj = AdpTrajectory.model_validate(raw)
    tokens = traj.details.get("tracerl_tokens")
    if isinstance(tokens, dict):  # the recorded ids: trained on as they are
        return EncodedDemo.model_validate(
            {"input_ids": tokens["input_ids"], "loss_mask": [bool(m) for m in tokens["loss_mask"]]}  # type: ignore[union-attr]
        )
    system = traj.details.get("system")
    tools = traj.details.get("tools") or []
    return Demo.model_validate({
        "messages": adp_to_messages(system if isinstance(system, str) else None, traj.content),
        "tools": tools,
    })  # fmt: skip


def _line(raw: object) -> Demo | EncodedDemo:
    if not isinstance(raw, dict):
        raise ValueError("each line must be a JSON object")
    if "messages" in raw:
        return Demo.model_validate({k: raw[k] for k in ("messages", "tools") if k in raw})
    if "content" in raw and "id" in raw:
        return _from_adp(raw)
    raise ValueError('expected {"messages": ...} (OpenAI) or {"id", "content"} (ADP)')


def read_training_file(path: str | Path) -> list[Demo | EncodedDemo]:
    """Training examples from JSONL whose lines are OpenAI chat lines or ADP trajectories
    (mixed freely): ADP with tracerl_tokens as its exact ids, everything else as a Demo."""
    out = []
    for n, raw in read_objects(path):
        try:
            out.append(_line(raw))
        except (ValidationError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: {e}") from None
    if not out:
        raise ValueError(f"{path}: no demonstrations")
    return out
