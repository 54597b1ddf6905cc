"""The OpenAI Responses API: POST /v1/responses (and GET /v1/responses/<id>) on the gateway.

A Responses call is served as a chat call: `instructions` and the `input` items become the
chat template's messages (a `message` item, the assistant's `function_call` items merged
into one assistant message with tool calls, `function_call_output` items as tool messages,
`reasoning` items dropped: the served models write none). So a Responses agent's second
turn extends its first exactly as a chat agent's does, and token-in/token-out reuses the
first turn's ids. Each call is one span.

Stored responses (`store`, the default) are kept in memory, per gateway and bounded, so
`previous_response_id` continues a conversation and GET returns them; `store: false`
responses are neither. Hosted tools the gateway cannot run (web_search, file_search,
computer_use_preview, custom, ...) are left out of the prompt with a warning; fields
clients send that the gateway has no use for (reasoning, include, prompt_cache_key, ...)
are accepted and ignored.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from tracerl.gateway.chat import ChatRequest, wire_message
from tracerl.gateway.core import Gateway
from tracerl.gateway.errors import GatewayError, invalid
from tracerl.gateway.served import Choice, Pending, Served
from tracerl.gateway.streaming import sse, stream_call
from tracerl.gateway.wire import (
    MODEL_CALL_DOC,
    REPLY_DOC,
    json_response,
    parent_of,
    read_json,
    rollout_of,
)
from tracerl.store.wire import body_doc, errors_doc

__all__ = ["ResponsesRequest", "register_responses"]

log = logging.getLogger(__name__)

STORED = 10_000
"""Stored responses kept per gateway; the oldest are forgotten first."""

_TEXT_PARTS = {"input_text", "output_text", "text"}
_warned: set[str] = set()


class ResponsesRequest(BaseModel):
    """A /v1/responses request; fields the gateway has no use for are accepted, ignored."""

    model_config = ConfigDict(extra="allow")

    model: str
    """Served model name, or an alias of one."""
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    """A user message as a string, or input items (messages, function calls and outputs)."""
    instructions: str | None = None
    """A system message put first (not carried over by previous_response_id)."""
    tools: list[dict[str, Any]] | None = None
    """Function tools ({"type": "function", "name", "parameters", ...}); hosted tools are
    dropped with a warning."""
    tool_choice: str | dict[str, Any] | None = None
    """Recorded and echoed; not enforced."""
    parallel_tool_calls: bool | None = None
    """Echoed."""
    max_output_tokens: int | None = Field(default=None, ge=1)
    """Upper bound on sampled tokens (capped by the context)."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    """Sampling temperature (default 1)."""
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    """Nucleus mass (default 1)."""
    text: dict[str, Any] | None = None
    """Output format; accepted and echoed (the reply is plain text)."""
    store: bool | None = None
    """Keep the response for previous_response_id and GET (default true)."""
    previous_response_id: str | None = None
    """Continue the conversation of a stored response."""
    metadata: dict[str, Any] | None = None
    """Echoed."""
    stream: bool | None = None
    """Answer as server-sent events."""


class Stored(BaseModel):
    """A stored response: its body and the conversation it closes."""

    body: dict[str, Any]
    """The response object as returned."""
    messages: list[dict[str, Any]]
    """Chat messages of its input (instructions left out) and its reply."""


def register_responses(app: FastAPI, gateway: Gateway) -> None:
    """Serve the Responses API at /v1/responses and /rollouts/<id>/v1/responses."""
    stored: OrderedDict[str, Stored] = OrderedDict()

    async def create(request: Request, rollout_id: str | None = None) -> Response:
        try:
            req = ResponsesRequest.model_validate(await read_json(request))
        except ValidationError as e:
            raise invalid(e) from None
        history = _previous(stored, req.previous_response_id)
        chat_req, messages = _chat_request(req, history)
        p = await gateway.open_chat(chat_req, rollout_of(request, rollout_id), parent_of(request))
        keep = _keeper(stored, req, messages)
        if req.stream:
            events = _events(gateway, p, req, keep)
            return StreamingResponse(events, media_type="text/event-stream")
        served = await gateway.run(p)
        body = _body(served, req, _output(served.choices[0]), "completed")
        keep(served, body)
        return json_response(body)

    async def retrieve(response_id: str, rollout_id: str | None = None) -> Response:
        found = stored.get(response_id)
        if found is None:
            raise GatewayError(
                404, f"No response with id '{response_id}' found.", "not_found_error"
            )
        return json_response(found.body)

    post: dict[str, Any] = {"openapi_extra": body_doc(TypeAdapter(ResponsesRequest)),
            "responses": {**REPLY_DOC, **MODEL_CALL_DOC}}  # fmt: skip
    get: dict[str, Any] = {"responses": {200: REPLY_DOC[200], **errors_doc(404)}}
    for prefix in ("", "/rollouts/{rollout_id}"):
        app.add_api_route(f"{prefix}/v1/responses", create, methods=["POST"], **post)
        app.add_api_route(
            f"{prefix}/v1/responses/{{response_id}}", retrieve, methods=["GET"], **get
        )


def _previous(stored: OrderedDict[str, Stored], response_id: str | None) -> list[dict[str, Any]]:
    if response_id is None:
        return []
    found = stored.get(response_id)
    if found is None:
        raise GatewayError(
            400,
            f"Previous response with id '{response_id}' not found (store: false responses, "
            "and ones this gateway forgot, cannot be continued).",
            param="previous_response_id",
        )
    return found.messages


Keep = Callable[[Served, dict[str, Any]], None]


def _keeper(
    stored: OrderedDict[str, Stored], req: ResponsesRequest, messages: list[dict[str, Any]]
) -> Keep:
    """What to do with a finished response: remember it when the request asks to store it."""

    def keep(served: Served, body: dict[str, Any]) -> None:
        if req.store is False:
            return
        reply = wire_message(served.choices[0].reply, served.choices[0].call_ids)
        stored[body["id"]] = Stored(body=body, messages=[*messages, reply])
        while len(stored) > STORED:
            stored.popitem(last=False)

    return keep


# -- request: Responses items -> chat messages ---------------------------------------------


def _chat_request(
    req: ResponsesRequest, history: list[dict[str, Any]]
) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """The chat request serving `req`, and its conversation without the instructions."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    messages = [*history, *_messages(items)]
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if not head and not messages:
        raise GatewayError(400, "input is empty", param="input")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": [*head, *messages],
        "tools": _function_tools(req.tools or []) or None,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
    }
    try:
        return ChatRequest.model_validate(body), messages
    except ValidationError as e:
        raise invalid(e) from None


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages; an assistant's function calls join its message."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            call = {
                "id": item.get("call_id", ""),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            content = _text(item.get("output"), i)
            out.append(
                {"role": "tool", "tool_call_id": item.get("call_id", ""), "content": content}
            )
        elif kind != "reasoning":  # the served models write no reasoning: nothing to keep
            raise GatewayError(
                400, f"input[{i}]: unsupported input item type {kind!r}", param=f"input[{i}]"
            )
    return out


def _text(content: Any, i: int) -> str:
    """A message's (or a tool output's) content as one string: text parts only."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _TEXT_PARTS or kind == "refusal":
                texts.append(str(part.get("text") or part.get("refusal") or ""))
            else:
                raise GatewayError(
                    400, f"input[{i}]: only text content is supported, not {kind!r}",
                    param=f"input[{i}].content",
                )  # fmt: skip
        return "".join(texts)
    raise GatewayError(400, f"input[{i}]: content must be a string or parts", f"input[{i}]")


def _function_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Function tools in chat form; hosted tools are left out, with a warning."""
    out = []
    for tool in tools:
        kind = str(tool.get("type"))
        if kind != "function":
            if kind not in _warned:
                _warned.add(kind)
                log.warning("tool type %r cannot run behind this gateway: left out", kind)
            continue
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


# -- response: choice -> output items -------------------------------------------------------


def _output(c: Choice) -> list[dict[str, Any]]:
    """The output items of a finished choice: its message (if it wrote text), its calls."""
    status = "incomplete" if c.finish_reason == "length" else "completed"
    items = [_message(c.reply.content, status)] if c.reply.content else []
    return items + [_call(call_id, call, "completed") for call_id, call in _calls(c)]


def _calls(c: Choice) -> list[tuple[str, dict[str, Any]]]:
    return list(
        zip(c.call_ids, wire_message(c.reply, c.call_ids).get("tool_calls", []), strict=True)
    )


def _message(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id or f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [_part(text)] if status != "in_progress" else [],
    }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call(call_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {
        "id": f"fc_{call_id.removeprefix('call_')}",
        "type": "function_call",
        "call_id": call_id,
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if status != "in_progress" else "",
        "status": status,
    }


def _body(
    served: Served | None, req: ResponsesRequest, output: list[dict[str, Any]], status: str,
    p: Pending | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The response object (in progress while streaming: no usage yet)."""
    span_id = served.span_id if served else p.span_id if p else ""
    usage = None
    if served is not None:
        usage = {
            "input_tokens": served.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": served.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": served.prompt_tokens + served.completion_tokens,
        }
        if served.choices[0].finish_reason == "length":
            status = "incomplete"
    return {
        "id": f"resp_{span_id}",
        "object": "response",
        "created_at": served.created if served else int(time.time()),
        "status": status,
        "model": req.model,
        "output": output,
        "usage": usage,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "metadata": req.metadata or {},
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tool_choice": req.tool_choice or "auto",
        "tools": [t for t in req.tools or [] if t.get("type") == "function"],
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "store": req.store is not False,
        "text": req.text or {"format": {"type": "text"}},
        "truncation": "disabled",
    }


# -- streaming --------------------------------------------------------------------------------


class _Events:
    """Numbers a response's events (sequence_number) and writes them as SSE."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(body, kind)


async def _events(
    gateway: Gateway, p: Pending, req: ResponsesRequest, keep: Keep
) -> AsyncIterator[bytes]:
    """created, in_progress, the message's text as it is sampled, each call, completed."""
    event = _Events()
    yield event("response.created", response=_body(None, req, [], "in_progress", p))
    yield event("response.in_progress", response=_body(None, req, [], "in_progress", p))
    msg_id, text, served = f"msg_{uuid.uuid4().hex}", "", None
    where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    async for piece in stream_call(gateway, p):
        if not isinstance(piece, str):
            served = piece
            break
        if not text:  # the message item opens with its first piece of text
            yield event(
                "response.output_item.added",
                output_index=0,
                item=_message("", "in_progress", msg_id),
            )
            yield event("response.content_part.added", part=_part(""), **where)
        text += piece
        yield event("response.output_text.delta", delta=piece, logprobs=[], **where)
    assert served is not None, "stream_call ends with the Served"
    c = served.choices[0]
    output: list[dict[str, Any]] = []
    if text:
        status = "incomplete" if c.finish_reason == "length" else "completed"
        yield event("response.output_text.done", text=text, logprobs=[], **where)
        yield event("response.content_part.done", part=_part(text), **where)
        output.append(_message(text, status, msg_id))
        yield event("response.output_item.done", output_index=0, item=output[-1])
    for call_id, call in _calls(c):
        index, done = len(output), _call(call_id, call, "completed")
        yield event(
            "response.output_item.added",
            output_index=index,
            item=_call(call_id, call, "in_progress"),
        )
        at = {"item_id": done["id"], "output_index": index}
        yield event("response.function_call_arguments.delta", delta=done["arguments"], **at)
        yield event(
            "response.function_call_arguments.done",
            arguments=done["arguments"],
            name=done["name"],
            **at,
        )
        output.append(done)
        yield event("response.output_item.done", output_index=index, item=done)
    body = _body(served, req, output, "completed")
    keep(served, body)
    kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
    yield event(kind, response=body)
