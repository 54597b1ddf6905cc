"""Refusals written before any route runs, by the ASGI middlewares that guard every request
(doors.py: Host, Origin and Content-Type; auth.py: keys; limits.py: the body and calls in
flight), in the error shape of the API the request's path belongs to:

- the Anthropic Messages API (/v1/messages..., also under /rollouts/<id>/): Anthropic's
  `{"type": "error", "error": {"type", "message"}}`, so its SDK reads every refusal;
- every other route: OpenAI's `{"error": {"message", "type", "param", "code"}}`, of which
  the store API's `{"error": {"message", "type"}}` is a part.

Refusals a route raises itself are its API's exception handlers' (gateway/app.py,
gateway/anthropic.py, store/http.py); these use the same two shapes.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import orjson
from starlette.requests import Request
from starlette.types import Scope, Send

__all__ = [
    "Refusal",
    "allowed_methods",
    "anthropic_type",
    "is_messages_api",
    "refusal_body",
    "refuse",
]

_MESSAGES_API = re.compile(r"^(/rollouts/[^/]+)?/v1/messages(/|$)")

ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
"""Anthropic's error `type` of each status (any other 4xx: invalid_request_error)."""


class Refusal(Exception):
    """A request refused before its route: the status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type, code
        self.headers = headers or {}
        """Extra response headers (WWW-Authenticate on a 401)."""


def is_messages_api(path: str) -> bool:
    """Whether `path` is a route of the Anthropic Messages API."""
    return _MESSAGES_API.match(path) is not None


def anthropic_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def refusal_body(path: str, r: Refusal) -> dict[str, Any]:
    """The refusal's JSON body, in the shape of the API `path` belongs to."""
    if is_messages_api(path):
        return {"type": "error", "error": {"type": anthropic_type(r.status), "message": r.message}}
    return {"error": {"message": r.message, "type": r.type, "param": None, "code": r.code}}


async def refuse(scope: Scope, send: Send, r: Refusal, close: bool = False) -> None:
    """Answer the request with `r`; `close` ends the connection after it (a body that was
    not read must not be taken for the next request)."""
    body = orjson.dumps(refusal_body(scope.get("path", ""), r))
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    headers += [(k.lower().encode(), v.encode()) for k, v in r.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": r.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def allowed_methods(request: Request, fallback: str = "") -> str:
    """The `Allow` of a 405: every method the API document lists at the request's path
    (Starlette names only the first route's, and /store/tasks has a GET route and a POST
    route); `fallback` for a path the document does not list."""
    document = getattr(request.app, "openapi", None)
    paths: dict[str, Any] = document().get("paths", {}) if document is not None else {}
    methods = {
        method.upper()
        for template, item in paths.items()
        if _template(template).fullmatch(request.url.path)
        for method in item
        if method.upper() in _METHODS
    }
    if "GET" in methods:
        methods.add("HEAD")  # Starlette answers HEAD wherever it answers GET
    return ", ".join(sorted(methods)) or fallback


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


@functools.cache
def _template(path: str) -> re.Pattern[str]:
    """A document path ("/store/rollouts/{rollout_id}") as a pattern of request paths."""
    return re.compile(re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(path)))
