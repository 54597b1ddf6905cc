"""What every HTTP route of the gateway shares, whatever API it speaks: reading a JSON body,
the attribution headers, writing JSON."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from tracerl.gateway.errors import GatewayError
from tracerl.store.wire import errors_doc
from tracerl.types import Rollout

__all__ = [
    "MODEL_CALL_DOC",
    "CallRoute",
    "Handler",
    "PARENT_HEADER",
    "REPLY_DOC",
    "ROLLOUT_HEADER",
    "add_call_route",
    "json_response",
    "parent_of",
    "read_json",
    "rollout_of",
]

MODEL_CALL_DOC = errors_doc(400, 404, 409, 429, 502)
"""OpenAPI statuses a model call may answer besides 200 (and the app-wide 401/403/408/413);
every API's error body has an `error` object with `message` and `type`."""
REPLY_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The reply (server-sent events when `stream` is true)",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
}
"""OpenAPI 200 of a model call: a JSON body, or an event stream."""

ROLLOUT_HEADER = "x-tracerl-rollout"
"""Names the rollout a call to plain /v1 belongs to."""
PARENT_HEADER = "x-tracerl-parent"
"""A sub-agent's call names the response id its parent agent received."""


Handler = Callable[..., Awaitable[Response]]
"""A model call's endpoint: `(request, **path_parameters) -> Response`."""


class CallRoute(APIRoute):
    """A model call's route: documented by FastAPI like any other, but served without
    FastAPI's per-request parameter solving. Its endpoint is called with the request and
    the path's parameters, and reads and validates its body itself (read_json, then
    pydantic), as every model call's endpoint does. That solving took about 7% of the
    gateway's event loop under bench/gateway.py's load (py-spy)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint

        async def handle(request: Request) -> Response:
            response: Response = await endpoint(request, **request.path_params)
            return response

        return handle


def add_call_route(app: FastAPI, path: str, endpoint: Handler, **doc: Any) -> None:
    """Serve `endpoint` for POST `path` as a CallRoute; `doc`: its OpenAPI arguments."""
    app.router.add_api_route(
        path, endpoint, methods=["POST"], route_class_override=CallRoute, **doc
    )


async def read_json(request: Request) -> Any:
    """The request body as JSON, or a 400."""
    body = await request.body()
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        error = e
    try:  # orjson reads no number beyond a double (a 400-digit integer is still JSON)
        return json.loads(body)
    except ValueError:
        raise GatewayError(400, f"request body is not valid JSON: {error}") from None


def rollout_of(request: Request, path_id: str | None) -> str | Rollout | None:
    """The rollout a call is attributed to: its URL path's or the header's id (looked up
    by the gateway), else its session's rollout, running at its last renewal
    (gateway/sessions.py, which may instead have refused the call)."""
    if path_id or request.headers.get(ROLLOUT_HEADER):
        return path_id or request.headers.get(ROLLOUT_HEADER)
    refusal = getattr(request.state, "refusal", None)
    if refusal is not None:
        raise refusal
    rollout: Rollout | None = getattr(request.state, "rollout", None)
    return rollout


def parent_of(request: Request) -> str | None:
    """The X-Tracerl-Parent header."""
    return request.headers.get(PARENT_HEADER)


def json_response(body: Any, status: int = 200) -> Response:
    """A JSON response serialised with orjson."""
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")
