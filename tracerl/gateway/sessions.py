"""Sessions: calls to plain /v1 that name no rollout are recorded under a session's rollout.

A coding CLI or a framework run by hand knows nothing of rollouts, yet its calls are the
traces worth keeping. So each such call is given a session key, and each key a rollout the
store opens already running (`Store.open_session`, max_attempts 1). The key is, in order:

1. the `X-Tracerl-Session` header (set it to keep runs apart on purpose);
2. a client's own session header: `X-Session-Id`, `X-Claude-Code-Session-Id` (Claude
   Code), `session_id` / `conversation_id` (Codex);
3. the body's `metadata.session_id`, else `metadata.user_id` (Anthropic Messages clients);
4. a hash of the API key the call presents (so one client process is one session).

A call renews the session's lease, unless one renewed it less than `RENEW_S` ago. A
session idle for `idle_s` is finished as succeeded (no reward: nobody judged it) by a sweep
on the gateway's loop; a gateway that dies leaves its sessions' leases to expire into
timed_out (never re-queued: max_attempts is 1).

With `record = "rollouts"` the gateway opens no sessions: an unattributed call gets a 400
naming X-Tracerl-Rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response

from tracerl.auth import key_of
from tracerl.gateway.errors import GatewayError
from tracerl.gateway.wire import ROLLOUT_HEADER, Handler
from tracerl.store import InvalidTransition, LeaseLost, NotFound, Store
from tracerl.types import Rollout, RolloutStatus

__all__ = ["CLIENT_SESSION_HEADERS", "SESSION_HEADER", "Sessions", "attributed", "session_key"]

log = logging.getLogger(__name__)
T = TypeVar("T")

SESSION_HEADER = "x-tracerl-session"
"""Names the session an unattributed call belongs to."""
CLIENT_SESSION_HEADERS = (
    "x-session-id",
    "x-claude-code-session-id",
    "session_id",
    "session-id",
    "conversation_id",
)
"""Session headers clients send of their own accord, tried in this order."""

RENEW_S = 1.0
"""A session's lease is renewed by its first call after this many seconds, not by every
call: a renewal is a store write (a hop to a store thread), and a stream of calls would pay
it each time. A session finished elsewhere meanwhile is noticed by the next renewal; a call
in flight then fails its span write (409), as one did before when it ended mid-sampling."""

Record = Literal["all", "rollouts"]


def session_key(headers: Mapping[str, str], body: Any, api_key: str | None) -> str:
    """The session a call belongs to (the module doc gives the order)."""
    for name in (SESSION_HEADER, *CLIENT_SESSION_HEADERS):
        value = headers.get(name, "").strip()
        if value:
            return value[:512]
    metadata = body.get("metadata") if isinstance(body, dict) else None
    if isinstance(metadata, dict):
        for field in ("session_id", "user_id"):
            given = metadata.get(field)
            if isinstance(given, str) and given.strip():
                return given.strip()[:512]
    # The key itself never reaches the store: only a digest of it.
    digest = hashlib.sha256((api_key or "").encode()).hexdigest()[:32]
    return f"api-key-sha256:{digest}"


@dataclass
class _Open:
    """A session this gateway holds open."""

    rollout: Rollout
    """Its rollout (attempt 1, the only one), as its last renewal found it: running."""
    last_used: float
    """When its last call arrived (monotonic seconds)."""
    renewed: float
    """When its lease was last renewed (monotonic seconds)."""


class Sessions:
    """Session key -> running rollout, renewed by its calls and finished when idle."""

    def __init__(
        self,
        store: Store,
        executor: Executor,
        idle_s: float = 300.0,
        lease_s: float = 900.0,
        renew_s: float = RENEW_S,
    ) -> None:
        if lease_s <= idle_s:
            raise ValueError("a session's lease must outlast its idle time")
        self.store = store
        self.idle_s = idle_s
        """Seconds without a call after which a session is finished."""
        self.lease_s = lease_s
        """Lease a renewal sets; it runs out only when the gateway is gone."""
        self.renew_s = renew_s
        """A call renews the lease when the last renewal is this many seconds old."""
        self._executor = executor
        self._open: dict[str, _Open] = {}
        self._lock = asyncio.Lock()
        self._sweeper: asyncio.Task[None] | None = None

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    async def rollout(self, key: str) -> Rollout:
        """The running rollout of session `key`, opened on its first call; its lease renewed
        (at most every renew_s). The renewal reads the rollout as it writes, so the call
        needs no other lookup."""
        self._start_sweeper()
        async with self._lock:  # two first calls of one key open one session
            entry = self._open.get(key)
            due = entry is not None and time.monotonic() - entry.renewed >= self.renew_s
            if entry is not None and due and not await self._renew(entry):
                entry = None
            if entry is None:
                rollout = await self._io(self.store.open_session, key, self.lease_s)
                now = time.monotonic()
                entry = self._open[key] = _Open(rollout, now, now)
            entry.last_used = time.monotonic()
            return entry.rollout

    async def rollout_id(self, key: str) -> str:
        """The id of `rollout(key)`."""
        return (await self.rollout(key)).id

    async def _renew(self, entry: _Open) -> bool:
        """Extend the lease; False when the session ended meanwhile (finished elsewhere)."""
        try:
            entry.rollout = await self._io(self.store.heartbeat, entry.rollout.id, 1, self.lease_s)
        except (LeaseLost, NotFound):
            return False
        entry.renewed = time.monotonic()
        return True

    async def sweep(self, now: float | None = None) -> list[str]:
        """Finish the sessions idle for idle_s (succeeded, no reward); their rollout ids."""
        now = time.monotonic() if now is None else now
        async with self._lock:
            idle = [k for k, e in self._open.items() if now - e.last_used >= self.idle_s]
            done = [self._open.pop(k).rollout.id for k in idle]
        for rollout_id in done:
            await self._io(self._finish, rollout_id)
        return done

    def _finish(self, rollout_id: str) -> None:
        # It may have ended already (its lease ran out while the gateway was stalled).
        with contextlib.suppress(LeaseLost, InvalidTransition, NotFound):
            self.store.finish(rollout_id, 1, RolloutStatus.succeeded)

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(max(self.idle_s / 4, 0.05))
            try:
                await self.sweep()
            except Exception:  # a store hiccup must not end the sweeps
                log.exception("session sweep failed")

    def close(self) -> None:
        """Finish every open session (the gateway is stopping; its loop has stopped)."""
        if self._sweeper is not None and not self._sweeper.done():
            self._sweeper.get_loop().call_soon_threadsafe(self._sweeper.cancel)
        for entry in self._open.values():
            self._finish(entry.rollout.id)
        self._open.clear()


def attributed(endpoint: Handler, store: Store | None, sessions: Sessions | None) -> Handler:
    """`endpoint`, a model call's, with the call attributed first: a plain /v1 call without
    X-Tracerl-Rollout is given its session's running rollout (request.state.rollout), or,
    without sessions, a refusal (request.state.refusal) that the route raises in its own
    API's error shape. It runs after the app's middlewares, the keys' check among them: a
    refused caller never opens a session."""

    @functools.wraps(endpoint)  # the signature FastAPI documents the route by
    async def call(request: Request, **path: str) -> Response:
        if not path.get("rollout_id"):  # /rollouts/<id>/v1/...: the path names the rollout
            await _attribute(request, store, sessions)
        return await endpoint(request, **path)

    return call


async def _attribute(request: Request, store: Store | None, sessions: Sessions | None) -> None:
    if store is None or request.headers.get(ROLLOUT_HEADER):
        return
    if sessions is None:
        request.state.refusal = GatewayError(
            400,
            "this gateway records rollouts only: send the header X-Tracerl-Rollout: <id>, "
            "or call /rollouts/<id>/v1",
            param=ROLLOUT_HEADER,
            code="rollout_required",
        )
        return
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        body = None  # the route answers that with its own 400
    key = session_key(request.headers, body, key_of(request))
    request.state.rollout = await sessions.rollout(key)
