"""The Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens on the gateway.

A Messages call is served as a chat call: `system` (a string or text blocks) becomes the
system message, an assistant's `text` and `tool_use` blocks one assistant message with tool
calls, a user's `tool_result` blocks tool messages and its `text` blocks user messages;
`thinking` blocks are dropped (the model's reasoning is in the span's ids already, and is
not part of the content the template re-renders). So an agent's next turn extends its last
one exactly, and token-in/token-out reuses its ids. Each call is one span. A model's
reasoning (`<think>...</think>`) comes back as a `thinking` block before its text.

What clients send beyond that is accepted: the x-api-key / Bearer key (checked before the
route, by tracerl.auth, whose refusals here are Anthropic-shaped too: tracerl.refusals),
anthropic-version and anthropic-beta headers, ?beta=true, cache_control, thinking,
context_management, output_config, metadata. Tools of server types the gateway cannot run
(web_search_..., bash_..., text_editor_..., computer_...) are left out with a warning.
Refusals are Anthropic-shaped: {"type": "error", "error": {"type": ..., "message": ...}}.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from tracerl.gateway.chat import ChatRequest, wire_message
from tracerl.gateway.core import Gateway
from tracerl.gateway.errors import GatewayError, invalid
from tracerl.gateway.served import Choice, Pending, Served
from tracerl.gateway.sessions import attributed
from tracerl.gateway.streaming import Thought, sse, stream_call
from tracerl.gateway.wire import (
    MODEL_CALL_DOC,
    REPLY_DOC,
    Handler,
    add_call_route,
    json_response,
    parent_of,
    read_json,
    rollout_of,
)
from tracerl.refusals import anthropic_type
from tracerl.store.wire import body_doc

__all__ = ["MessagesRequest", "register_messages"]

log = logging.getLogger(__name__)

_DROPPED_BLOCKS = {"thinking", "redacted_thinking"}
_warned: set[str] = set()


class MessagesRequest(BaseModel):
    """A /v1/messages request; fields the gateway has no use for are accepted, ignored."""

    model_config = ConfigDict(extra="allow")

    model: str
    """Served model name, or an alias of one (clients hard-code e.g. claude-sonnet-4-5)."""
    messages: list[dict[str, Any]] = Field(min_length=1)
    """The conversation: user and assistant turns, content a string or blocks."""
    system: str | list[dict[str, Any]] | None = None
    """The system prompt: a string or text blocks (cache_control ignored)."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Upper bound on sampled tokens (capped by the context; default the model's)."""
    tools: list[dict[str, Any]] | None = None
    """Tools ({"name", "description", "input_schema"}); server tools are dropped."""
    tool_choice: dict[str, Any] | None = None
    """{"type": "any"} or {"type": "tool", "name": ...} forces a call where decoding is
    constrained; "auto" and "none" force nothing."""
    stop_sequences: list[str] | None = None
    """Strings that end the completion (stop_reason "stop_sequence")."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    """Sampling temperature (default 1)."""
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    """Nucleus mass (default 1)."""
    metadata: dict[str, Any] | None = None
    """Accepted (user_id...)."""
    stream: bool | None = None
    """Answer as server-sent events."""


def error_body(e: GatewayError) -> dict[str, Any]:
    """A refusal in Anthropic's error shape (the refusals before the route share it:
    tracerl.refusals)."""
    message = e.message
    if e.code == "context_length_exceeded":  # Anthropic's words, which Claude clients act on
        message = f"prompt is too long: {message}"
    return {"type": "error", "error": {"type": anthropic_type(e.status), "message": message}}


def register_messages(app: FastAPI, gateway: Gateway) -> None:
    """Serve the Messages API at /v1/messages and /rollouts/<id>/v1/messages."""

    async def create(request: Request, rollout_id: str | None = None) -> Response:
        req = _request(await read_json(request))
        gateway.check_model(req.model)  # first: a call is judged once its model is known
        p = await gateway.open_chat(_chat(req), rollout_of(request, rollout_id), parent_of(request))
        if req.stream:
            return StreamingResponse(_events(gateway, p), media_type="text/event-stream")
        return json_response(_body(p, await gateway.run(p)))

    async def count_tokens(request: Request, rollout_id: str | None = None) -> Response:
        req = _request(await read_json(request))
        gateway.check_model(req.model)
        return json_response({"input_tokens": await gateway.count_tokens(_chat(req))})

    # Anthropic's error body ({"type": "error", "error": {"type", "message"}}) has the
    # `error` object every API's refusal shares, so one declared schema fits all.
    doc: dict[str, Any] = {"openapi_extra": body_doc(TypeAdapter(MessagesRequest)),
           "responses": {**REPLY_DOC, **MODEL_CALL_DOC}}  # fmt: skip
    for prefix in ("", "/rollouts/{rollout_id}"):
        served = attributed(create, gateway.store, gateway.sessions)
        add_call_route(app, f"{prefix}/v1/messages", _shaped(served), **doc)
        add_call_route(app, f"{prefix}/v1/messages/count_tokens", _shaped(count_tokens), **doc)


def _shaped(handler: Handler) -> Handler:
    """The handler with every refusal (and failure) written in Anthropic's error shape."""

    async def shaped(request: Request, rollout_id: str | None = None) -> Response:
        try:
            return await handler(request, rollout_id=rollout_id)
        except GatewayError as e:
            return json_response(error_body(e), e.status)
        except Exception as e:  # a traceback never reaches the client
            log.exception("gateway failure")
            return json_response(error_body(GatewayError(500, f"internal error: {e}")), 500)

    return shaped


def _request(raw: Any) -> MessagesRequest:
    try:
        return MessagesRequest.model_validate(raw)
    except ValidationError as e:
        raise invalid(e) from None


# -- request: Messages blocks -> chat messages -----------------------------------------------


def _chat(req: MessagesRequest) -> ChatRequest:
    """The chat request serving `req`."""
    system = _system(req.system)
    messages = [{"role": "system", "content": system}] if system else []
    for i, message in enumerate(req.messages):
        messages.extend(_turn(message, i))
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "tools": _tools(req.tools or []) or None,
        "max_tokens": req.max_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tool_choice": _tool_choice(req.tool_choice),
    }
    try:
        chat = ChatRequest.model_validate(body)
    except ValidationError as e:
        raise invalid(e) from None
    chat.stop = [s for s in req.stop_sequences or [] if s] or None  # any number of them
    return chat


def _tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    """The chat form of a Messages tool_choice."""
    kind = (choice or {}).get("type")
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": (choice or {}).get("name")}}
    return None


def _system(system: str | list[dict[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "".join(_block_text(b, "system") for b in system)


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise GatewayError(
            400, f"{where}: only text blocks are supported here, not {kind!r}", where
        )
    return str(block.get("text", ""))


def _turn(message: dict[str, Any], i: int) -> list[dict[str, Any]]:
    """One Messages turn as chat messages."""
    role, content, where = message.get("role"), message.get("content"), f"messages.{i}"
    if role not in ("user", "assistant", "system"):
        refusal = f"{where}.role: must be 'user', 'assistant' or 'system', not {role!r}"
        raise GatewayError(400, refusal, where)
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}.content: must be a string or a list of blocks", where)
    if role == "system":  # a system turn mid-conversation (Claude Code 2.1 sends them)
        return [{"role": "system", "content": "".join(_block_text(b, where) for b in content)}]
    blocks = [b for b in content if not (isinstance(b, dict) and b.get("type") in _DROPPED_BLOCKS)]
    return _assistant(blocks, where) if role == "assistant" else _user(blocks, where)


def _assistant(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    text, calls = [], []
    for block in blocks:
        if isinstance(block, dict) and block.get("type") == "tool_use":
            fn = {"name": block.get("name"), "arguments": block.get("input") or {}}
            calls.append({"id": str(block.get("id", "")), "type": "function", "function": fn})
        else:
            text.append(_block_text(block, where))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """Tool results as tool messages, text as user messages, in the order given."""
    out: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, dict) and block.get("type") == "tool_result":
            result = block.get("content")
            if isinstance(result, list):
                result = "".join(_block_text(b, f"{where}.tool_result") for b in result)
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(block.get("tool_use_id", "")),
                    "content": result or "",
                }
            )
        elif out and out[-1]["role"] == "user":
            out[-1]["content"] += _block_text(block, where)
        else:
            out.append({"role": "user", "content": _block_text(block, where)})
    return out


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Client tools in chat form; server tools are left out, with a warning."""
    out = []
    for tool in tools:
        kind = tool.get("type") or "custom"
        if kind != "custom":
            if kind not in _warned:
                _warned.add(kind)
                log.warning("tool type %r cannot run behind this gateway: left out", kind)
            continue
        fn = {"name": tool.get("name"), "parameters": tool.get("input_schema") or {}}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


# -- response ------------------------------------------------------------------------------------


def _stop(c: Choice) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if c.reply.tool_calls:
        return "tool_use", None
    if c.gen.stop_string:
        return "stop_sequence", c.gen.stop_string
    return ("max_tokens", None) if c.finish_reason == "length" else ("end_turn", None)


def _tool_uses(c: Choice) -> list[dict[str, Any]]:
    calls = wire_message(c.reply, c.call_ids).get("tool_calls", [])
    return [
        {
            "type": "tool_use",
            "id": f"toolu_{call['id'].removeprefix('call_')}",
            "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"]),
        }
        for call in calls
    ]


def _head(p: Pending, content: list[dict[str, Any]], output_tokens: int) -> dict[str, Any]:
    return {
        "id": f"msg_{p.span_id}",
        "type": "message",
        "role": "assistant",
        "model": p.model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": len(p.prompt.ids),
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def _thinking(text: str) -> dict[str, Any]:
    """A thinking block with the model's own reasoning (unsigned: nothing to verify)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def _body(p: Pending, served: Served) -> dict[str, Any]:
    c = served.choices[0]
    thinking = [_thinking(c.reply.reasoning)] if c.reply.reasoning else []
    text = [{"type": "text", "text": c.reply.content}] if c.reply.content else []
    body = _head(p, thinking + text + _tool_uses(c), served.completion_tokens)
    body["stop_reason"], body["stop_sequence"] = _stop(c)
    return body


async def _events(gateway: Gateway, p: Pending) -> AsyncIterator[bytes]:
    """message_start, ping, the thinking block once the reasoning closes, the text block as
    it is sampled, each tool_use block, message_delta (stop reason, usage), message_stop; an
    error event if sampling fails."""

    def event(kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, **fields}, kind)

    yield event("message_start", message=_head(p, [], 0))
    yield event("ping")
    index, text_at, served = 0, None, None  # the next block's index; the text block's
    try:
        async for piece in stream_call(gateway, p):
            if isinstance(piece, Served):
                served = piece
                break
            if isinstance(piece, Thought):  # it closes before any text: the first block
                yield event("content_block_start", index=index, content_block=_thinking(""))
                delta = {"type": "thinking_delta", "thinking": piece.text}
                yield event("content_block_delta", index=index, delta=delta)
                yield event("content_block_stop", index=index)
                index += 1
                continue
            if text_at is None:
                text_at, index = index, index + 1
                block = {"type": "text", "text": ""}
                yield event("content_block_start", index=text_at, content_block=block)
            delta = {"type": "text_delta", "text": piece}
            yield event("content_block_delta", index=text_at, delta=delta)
    except GatewayError as e:
        yield event("error", error=error_body(e)["error"])
        return
    assert served is not None, "stream_call ends with the Served"
    if text_at is not None:
        yield event("content_block_stop", index=text_at)
    c = served.choices[0]
    for block in _tool_uses(c):
        yield event("content_block_start", index=index, content_block={**block, "input": {}})
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield event("content_block_delta", index=index, delta=delta)
        yield event("content_block_stop", index=index)
        index += 1
    reason, sequence = _stop(c)
    yield event(
        "message_delta",
        delta={"stop_reason": reason, "stop_sequence": sequence},
        usage={"output_tokens": served.completion_tokens},
    )
    yield event("message_stop")
