"""What one request may ask of the service, refused early with a clear error.

`LimitsMiddleware` (pure ASGI, so it sees every route, the store's and any API module's)
reads each request body before the route does: past `max_body_bytes` (announced by
Content-Length, or counted while it streams in) is a 413; a body that stops arriving
before `body_timeout_s` is a 408, so a client announcing 10 MB and sending 10 bytes gets
an answer instead of holding a connection and a buffer forever. It also caps the model
calls in flight per rollout (429): one runaway agent cannot queue thousands of generations
in front of every other rollout.

`max_n` and `max_tokens` bound each model call (the gateway checks them once the body is
parsed), `max_lease_s` each lease asked of the store API (tracerl.store.http), and
`unless_disconnected` cancels a call whose client has gone: an engine generating for nobody
only slows everyone else, and a cancelled call is never recorded as a span (there is no
reply the agent acted on).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tracerl.refusals import Refusal, refuse

__all__ = ["ClientGone", "Limits", "LimitsMiddleware", "unless_disconnected"]

T = TypeVar("T")

_MODEL_CALL = re.compile(r"^/rollouts/([^/]+)/v1/")


class Limits(BaseModel):
    """Bounds on what one request may ask (each refusal a 4xx naming the bound)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", frozen=True)

    max_body_bytes: int = Field(default=64 * 2**20, ge=1)
    """Largest request body, in bytes (413 beyond): spans of long conversations are big."""
    body_timeout_s: float = Field(default=60.0, gt=0)
    """Seconds a request body may take to arrive in full (408 after)."""
    max_n: int = Field(default=16, ge=1)
    """Most choices one model call may ask for (`n`)."""
    max_tokens: int = Field(default=32_768, ge=1)
    """Largest `max_tokens` a model call may ask for (it is also clipped to the context)."""
    max_in_flight: int = Field(default=64, ge=1)
    """Model calls of one rollout in flight at once (429 beyond)."""
    max_lease_s: float = Field(default=3600.0, gt=0, allow_inf_nan=False)
    """Longest lease a claim, heartbeat or session may ask the store API for, in seconds
    (422 beyond): a runner that dies holding a lease keeps its rollout from being re-queued
    until the lease runs out. Runners renew theirs (every lease_s / 3), so leases need not
    be long."""


class ClientGone(Exception):
    """The client disconnected before its reply was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientGone) if the client disconnects first.

    The body has been read by then, so the next ASGI message is the disconnect. `work` runs
    in the caller's own task: a watcher task cancels that task when the disconnect comes, so
    a call costs one task, not two and an asyncio.wait (a hop of the event loop fewer on
    every call). The cancellation reaches the engine before ClientGone is raised."""
    task = asyncio.current_task()
    assert task is not None
    answered = False

    def left(watcher: asyncio.Future[None]) -> None:
        if not answered and not watcher.cancelled() and watcher.exception() is None:
            task.cancel()

    gone = asyncio.ensure_future(_disconnect(request))
    gone.add_done_callback(left)
    try:
        return await work
    except asyncio.CancelledError:
        client_left = gone.done() and not gone.cancelled() and gone.exception() is None
        if client_left and task.uncancel() == 0:  # nobody else asked this task to stop
            raise ClientGone() from None
        raise
    finally:
        answered = True  # a disconnect noticed from now on cancels nothing
        gone.cancel()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class LimitsMiddleware:
    """Body size and arrival time, and per-rollout concurrency, for every HTTP route."""

    def __init__(self, app: ASGIApp, limits: Limits) -> None:
        self.app = app
        self.limits = limits
        self.in_flight: dict[str, int] = {}
        """Model calls in flight per rollout id (absent: none)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._body(scope, receive)
        except Refusal as e:  # the rest of the body is not read: the connection closes
            await refuse(scope, send, e, close=True)
            return
        except ClientGone:
            return
        rollout = _rollout_of(scope)
        if rollout is not None and self.in_flight.get(rollout, 0) >= self.limits.max_in_flight:
            limit = self.limits.max_in_flight
            message = f"rollout {rollout!r} already has {limit} model calls in flight"
            await refuse(scope, send, _refusal(429, message, "too_many_calls_in_flight"))
            return
        if rollout is not None:
            self.in_flight[rollout] = self.in_flight.get(rollout, 0) + 1
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            if rollout is not None:
                self._release(rollout)

    def _release(self, rollout: str) -> None:
        left = self.in_flight[rollout] - 1
        if left:
            self.in_flight[rollout] = left
        else:
            del self.in_flight[rollout]

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        """The whole body, within the size and time bounds."""
        limit = self.limits.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            raise _refusal(413, f"request body of {declared} bytes is over {limit}", "too_large")
        try:
            # A timeout scope, not wait_for: no task per request.
            async with asyncio.timeout(self.limits.body_timeout_s):
                return await _read(receive, limit)
        except TimeoutError:
            raise _refusal(
                408,
                f"request body did not arrive within {self.limits.body_timeout_s:g}s",
                "request_timeout",
            ) from None


async def _read(receive: Receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _refusal(413, f"request body is over {limit} bytes", "too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read already, once; then the connection's own messages (the disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _rollout_of(scope: Scope) -> str | None:
    """The rollout a model call is for (by path, or the header on /v1/...); None else."""
    if scope.get("method") != "POST":
        return None
    path = scope.get("path", "")
    if match := _MODEL_CALL.match(path):
        return match.group(1)
    if path.startswith("/v1/"):
        for name, value in scope.get("headers", []):
            if name == b"x-tracerl-rollout":
                return str(value.decode("latin-1"))
    return None


def _refusal(status: int, message: str, code: str) -> Refusal:
    kind = "rate_limit_error" if status == 429 else "invalid_request_error"
    return Refusal(status, message, kind, code)
