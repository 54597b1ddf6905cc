"""The gateway's HTTP face: OpenAI-compatible routes, server-sent events, JSON errors.

Routes exist twice: at /v1/... (the rollout comes from the X-Tracerl-Rollout header, else
the call is recorded under its session's rollout: gateway/sessions.py) and at /rollouts/<id>/v1/..., so an agent is
attributed just by its base_url. A sub-agent says who spawned it with X-Tracerl-Parent: the
`id` of the completion its parent agent received. Every refusal is an OpenAI-style JSON
error with a 4xx status; a traceback never reaches the client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Collection
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from tracerl.auth import Keys
from tracerl.doors import guard_app
from tracerl.gateway.anthropic import register_messages
from tracerl.gateway.chat import ChatRequest, CompletionRequest, wire_message
from tracerl.gateway.core import Choice, Gateway, GatewayError, Served, decode, invalid
from tracerl.gateway.responses import register_responses
from tracerl.gateway.sessions import attributed
from tracerl.gateway.streaming import chat_events, completion_events
from tracerl.gateway.wire import (  # noqa: F401  ROLLOUT_HEADER is re-exported
    MODEL_CALL_DOC,
    PARENT_HEADER,
    REPLY_DOC,
    ROLLOUT_HEADER,
    add_call_route,
    read_json,
    rollout_of,
)
from tracerl.limits import ClientGone, Limits, unless_disconnected
from tracerl.refusals import allowed_methods
from tracerl.store.http import document, install_error_handlers, store_router
from tracerl.store.wire import body_doc, errors_doc, validate_strictly
from tracerl.types import RewardValue

log = logging.getLogger(__name__)


class RewardRequest(BaseModel):
    """A reward an agent emits over HTTP (POST /rollouts/<id>/reward)."""

    # The API document says what _one_target checks: span_seq or role, not both.
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"properties": {"span_seq": {"type": "null"}}},
                {"properties": {"role": {"type": "null"}}},
            ]
        }
    )

    value: RewardValue
    """The reward: finite, within types.REWARD_LIMIT (400 otherwise)."""
    span_seq: int | None = Field(default=None, ge=0, lt=2**31)
    """Seq of the call it rewards, for a per-step reward; None for a final reward."""
    role: str | None = Field(default=None, min_length=1, max_length=128)
    """For a per-role final reward, the role (model name) it credits instead of the
    trajectory's outcome; None for the trajectory's own reward."""
    name: str = Field(default="reward", max_length=64)
    """A label for reports."""

    @model_validator(mode="after")
    def _one_target(self) -> RewardRequest:
        if self.span_seq is not None and self.role is not None:
            raise ValueError("give span_seq (a per-step reward) or role, not both")
        return self


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def error_response(e: GatewayError) -> Response:
    """An OpenAI-style error body."""
    err = {"message": e.message, "type": e.type, "param": e.param, "code": e.code}
    return _json({"error": err}, e.status)


def _check_sampling(limits: Limits, n: int, max_tokens: int | None) -> None:
    """A 400 when a call asks for more choices or tokens than the service allows."""
    if n > limits.max_n:
        raise GatewayError(400, f"n must be at most {limits.max_n}", param="n", code="n_too_large")
    if max_tokens is not None and max_tokens > limits.max_tokens:
        message = f"max_tokens must be at most {limits.max_tokens}"
        raise GatewayError(400, message, param="max_tokens", code="max_tokens_too_large")


REWARD = TypeAdapter(RewardRequest)

_ROUTES: dict[str, dict[str, Any]] = {
    "chat": {"openapi_extra": body_doc(TypeAdapter(ChatRequest)), "responses": {
        **REPLY_DOC, **MODEL_CALL_DOC, **errors_doc(502)}},
    "complete": {"openapi_extra": body_doc(TypeAdapter(CompletionRequest)), "responses": {
        **REPLY_DOC, **MODEL_CALL_DOC}},
    "models": {"responses": errors_doc(404)},
    "reward": {"openapi_extra": body_doc(REWARD),
               "responses": errors_doc(400, 404, 409)},
}  # fmt: skip
"""Each route's OpenAPI request body and statuses (handlers parse raw bytes themselves)."""


def create_app(
    gateway: Gateway,
    with_store_api: bool = True,
    keys: Keys | None = None,
    limits: Limits | None = None,
    hosts: Collection[str] = (),
) -> FastAPI:
    """The FastAPI app serving the OpenAI routes (and the store's API under /store), behind
    `keys` (None: every route open, the loopback default) and `limits`. Without keys it
    answers to loopback Host names and `hosts` (the address it listens on) only."""
    keys = keys or Keys()
    limits = limits or Limits()
    app = FastAPI(
        title="tracerl gateway",
        docs_url=None,
        redoc_url=None,
        responses=errors_doc(401, 403, 408, 413, 415),
    )
    guard_app(app, keys, limits, gateway.store, gateway.store_executor, hosts)
    install_error_handlers(app)
    _install_gateway_errors(app)

    async def chat(request: Request, rollout_id: str | None = None) -> Response:
        try:
            req = ChatRequest.model_validate(await read_json(request))
        except ValidationError as e:
            raise invalid(e) from None
        gateway.check_model(req.model, remote=True)
        _check_sampling(limits, req.n, req.token_limit())
        parent = request.headers.get(PARENT_HEADER)
        usage = bool((req.stream_options or {}).get("include_usage"))
        target = rollout_of(request, rollout_id)
        if gateway.role(req.model) in gateway.remote:
            body = await unless_disconnected(request, gateway.chat_remote(req, target, parent))
            if req.stream:
                events = _reply_events(body, usage)
                return StreamingResponse(events, media_type="text/event-stream")
            return _json(body)
        pending = await gateway.open_chat(req, target, parent)
        if req.stream:
            events = chat_events(gateway, pending, usage)
            return StreamingResponse(events, media_type="text/event-stream")
        served = await unless_disconnected(request, gateway.run(pending))
        return _json(_chat_body(served, req.logprobs))

    async def complete(request: Request, rollout_id: str | None = None) -> Response:
        try:
            req = CompletionRequest.model_validate(await read_json(request))
        except ValidationError as e:
            raise invalid(e) from None
        gateway.check_model(req.model)
        _check_sampling(limits, req.n, req.max_tokens)
        parent = request.headers.get(PARENT_HEADER)
        pending = await gateway.open_complete(req, rollout_of(request, rollout_id), parent)
        if req.stream:
            usage = bool((req.stream_options or {}).get("include_usage"))
            events = completion_events(gateway, pending, usage)
            return StreamingResponse(events, media_type="text/event-stream")
        served = await unless_disconnected(request, gateway.run(pending))
        return _json(_completion_body(served, req.logprobs is not None))

    async def models(request: Request, rollout_id: str | None = None) -> Response:
        now = int(time.time())
        data = [
            {"id": name, "object": "model", "created": now, "owned_by": "tracerl"}
            for name in gateway.names
        ]
        return _json({"object": "list", "data": data})

    async def reward(request: Request, rollout_id: str) -> Response:
        try:
            req = validate_strictly(REWARD, await request.body())
        except ValidationError as e:
            raise invalid(e) from None
        await gateway.reward(rollout_id, req.value, req.span_seq, req.role, req.name)
        return _json({"ok": True})

    async def health(request: Request) -> Response:
        return _json({"ok": True, "models": gateway.names})

    for prefix in ("", "/rollouts/{rollout_id}"):
        for path, endpoint, doc in (
            ("chat/completions", chat, _ROUTES["chat"]),
            ("completions", complete, _ROUTES["complete"]),
        ):
            served = attributed(endpoint, gateway.store, gateway.sessions)
            add_call_route(app, f"{prefix}/v1/{path}", served, **doc)
        app.add_api_route(f"{prefix}/v1/models", models, methods=["GET"], **_ROUTES["models"])
    register_responses(app, gateway)
    register_messages(app, gateway)
    app.add_api_route(
        "/rollouts/{rollout_id}/reward", reward, methods=["POST"], **_ROUTES["reward"]
    )
    app.add_api_route("/health", health, methods=["GET"])
    if with_store_api and gateway.store is not None:
        store_api = store_router(
            gateway.store, gateway.store_executor, keys, gateway.finished, limits
        )
        app.include_router(store_api, prefix="/store")
        document(app)
    return app


def _install_gateway_errors(app: FastAPI) -> None:
    """OpenAI-style errors for the gateway's routes; the store's keep their own shape."""

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, e: GatewayError) -> Response:
        return error_response(e)

    store_validation = app.exception_handlers[RequestValidationError]

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> Response:
        if request.url.path.startswith("/store/"):  # the store API answers 422, as documented
            return await store_validation(request, e)  # type: ignore[misc]
        return error_response(GatewayError(400, str(e.errors()[0].get("msg", e))))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        response = error_response(GatewayError(e.status_code, str(e.detail), type=kind))
        response.headers.update(e.headers or {})
        if e.status_code == 405:  # every method the path takes, not only one route's
            response.headers["Allow"] = allowed_methods(request, response.headers["Allow"])
        return response

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the client has left

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> Response:
        log.exception("gateway failure")
        return error_response(GatewayError(500, f"internal error: {e}", type="server_error"))


def _usage(served: Served) -> dict[str, int]:
    return {
        "prompt_tokens": served.prompt_tokens,
        "completion_tokens": served.completion_tokens,
        "total_tokens": served.prompt_tokens + served.completion_tokens,
    }


def _token(served: Served, tid: int, lp: float) -> dict[str, Any]:
    """One token's entry in OpenAI's chat logprobs: its spelling, log-prob, text bytes."""
    text = decode(served.tokenizer, [tid], skip_special=False)
    token = served.tokenizer.convert_ids_to_tokens(tid)
    return {"token": token, "logprob": lp, "bytes": list(text.encode())}


def _token_logprobs(served: Served, c: Choice) -> list[dict[str, Any]]:
    """Each sampled token's entry, with its position's most likely tokens when asked for
    (an engine that returns none leaves them empty)."""
    tops = c.gen.top_logprobs or [[] for _ in c.gen.completion_ids]
    out = []
    for tid, lp, top in zip(c.gen.completion_ids, c.gen.logprobs, tops, strict=True):
        alternatives = [_token(served, t, v) for t, v in top]
        out.append({**_token(served, tid, lp), "top_logprobs": alternatives, "token_id": tid})
    return out


def _chat_body(served: Served, logprobs: bool) -> dict[str, Any]:
    choices = []
    for c in served.choices:
        choice: dict[str, Any] = {
            "index": c.index,
            "message": wire_message(c.reply, c.call_ids),
            "finish_reason": c.finish_reason,
            "logprobs": {"content": _token_logprobs(served, c)} if logprobs else None,
        }
        choices.append(choice)
    return {
        "id": served.id,
        "object": "chat.completion",
        "created": served.created,
        "model": served.model,
        "choices": choices,
        "usage": _usage(served),
    }


def _completion_body(served: Served, logprobs: bool) -> dict[str, Any]:
    choices = []
    for c in served.choices:
        lp = None
        if logprobs:
            tokens = _token_logprobs(served, c)
            tops = [{a["token"]: a["logprob"] for a in t["top_logprobs"]} for t in tokens]
            lp = {
                "tokens": [t["token"] for t in tokens],
                "token_logprobs": [t["logprob"] for t in tokens],
                "top_logprobs": tops if c.gen.top_logprobs else None,
                "text_offset": [],
            }
        choices.append(
            {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": lp}
        )
    return {
        "id": served.id,
        "object": "text_completion",
        "created": served.created,
        "model": served.model,
        "choices": choices,
        "usage": _usage(served),
    }


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def _reply_events(body: dict[str, Any], usage: bool) -> AsyncIterator[bytes]:
    """A finished chat reply (a remote role's) as a stream: each choice's message in one
    delta, then its finish reason."""
    head = {k: body.get(k) for k in ("id", "created", "model")} | {
        "object": "chat.completion.chunk"
    }
    if usage:  # every chunk says "usage": null until the last one carries it
        head["usage"] = None
    for i, choice in enumerate(body["choices"]):
        message = choice["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            calls = message["tool_calls"]
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        index = choice.get("index", i)
        yield _sse({**head, "choices": [{"index": index, "delta": delta}]})
        done = {"index": index, "delta": {}, "finish_reason": choice.get("finish_reason")}
        yield _sse({**head, "choices": [done]})
    if usage and body.get("usage"):
        yield _sse({**head, "choices": [], "usage": body["usage"]})
    yield b"data: [DONE]\n\n"
