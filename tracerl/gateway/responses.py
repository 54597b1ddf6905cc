"""The OpenAI Responses API: POST /v1/responses (and GET /v1/responses/<id>) on the gateway.

A Responses call is served as a chat call: `instructions` and the `input` items become the
chat template's messages (a `message` item, the assistant's `function_call` items merged
into one assistant message with tool calls, `function_call_output` items as tool messages,
`reasoning` items dropped: a model's reasoning is in the span's ids already, and not part
of the content the template re-renders). So a Responses agent's second
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
from collections import OrderedDict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from tracerl.gateway.chat import ChatRequest, wire_message
from tracerl.gateway.core import Gateway
from tracerl.gateway.errors import GatewayError, invalid
from tracerl.gateway.responses_out import Keep, body, events, output
from tracerl.gateway.served import Served
from tracerl.gateway.sessions import attributed
from tracerl.gateway.wire import (
    MODEL_CALL_DOC,
    REPLY_DOC,
    add_call_route,
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
    """"required" or {"type": "function", "name": ...} forces a call where decoding is
    constrained; echoed."""
    parallel_tool_calls: bool | None = None
    """Echoed."""
    max_output_tokens: int | None = Field(default=None, ge=1)
    """Upper bound on sampled tokens (capped by the context)."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    """Sampling temperature (default 1)."""
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    """Nucleus mass (default 1)."""
    text: dict[str, Any] | None = None
    """{"format": {"type": "json_schema", "schema": ...}} or json_object: the reply is JSON
    (of the schema) where decoding is constrained; echoed."""
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
        gateway.check_model(req.model)  # first: a call is judged once its model is known
        history = _previous(stored, req.previous_response_id)
        chat_req, messages = _chat_request(req, history)
        p = await gateway.open_chat(chat_req, rollout_of(request, rollout_id), parent_of(request))
        keep = _keeper(stored, req, messages)
        if req.stream:
            stream = events(gateway, p, req, keep)
            return StreamingResponse(stream, media_type="text/event-stream")
        served = await gateway.run(p)
        reply = body(served, req, output(served.choices[0]), "completed")
        keep(served, reply)
        return json_response(reply)

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
        served = attributed(create, gateway.store, gateway.sessions)
        add_call_route(app, f"{prefix}/v1/responses", served, **post)
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
        "tool_choice": _tool_choice(req.tool_choice),
        "response_format": _response_format(req.text),
    }
    try:
        return ChatRequest.model_validate(body), messages
    except ValidationError as e:
        raise invalid(e) from None


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """The chat form of a Responses tool_choice (hosted-tool choices force nothing)."""
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            return None
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat response_format of a Responses `text.format`."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt if isinstance(fmt, dict) else None
    fields = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": fields}


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
