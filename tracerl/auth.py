"""Who may call what: the service's keys, the principal each key names, and the check every
request gets from its headers, before its body is read (KeysMiddleware).

Three kinds of key:

- the admin (trainer) key: everything — publish versions, requeue, enqueue, read all;
- runner keys, each bound to a runner id: claim rollouts (recorded under that id), and
  heartbeat, finish and read the rollouts whose lease that id holds;
- agent keys, one per claimed attempt, returned with the claim: the attempt's own model calls
  (/rollouts/<id>/v1/...) and its reward, nothing else, and dead once the attempt ends.

An agent key is `ak.<rollout id>.<attempt>.<HMAC>`: the gateway checks it with no table of
minted keys (so several gateway processes, and a restarted one, accept the same keys when
they share the admin key the HMAC secret derives from) and it dies with its attempt, since
the check also asks the store that the attempt still runs.

Keys come from the environment (TRACERL_ADMIN_KEY, TRACERL_RUNNER_KEYS="id=key,...") or a
TOML keys file, never from the command line (argv is visible to every user of the machine)
and never into logs. Keys are compared with hmac.compare_digest. With no key configured
everything is open, as on a laptop; `tracerl serve` refuses to listen beyond loopback so
(and doors.py refuses what web pages could send it).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import tomllib
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from tracerl.refusals import Refusal, refuse
from tracerl.store import NotFound, Store
from tracerl.types import Rollout, RolloutStatus

__all__ = [
    "AccessDenied",
    "Keys",
    "KeysMiddleware",
    "Principal",
    "Role",
    "access_of",
    "is_loopback",
    "key_of",
]

ROLLOUT_HEADER = "x-tracerl-rollout"
AGENT_PREFIX = "ak"


class Role(StrEnum):
    """What a key is."""

    anonymous = "anonymous"
    agent = "agent"
    runner = "runner"
    admin = "admin"


@dataclass(frozen=True)
class Principal:
    """The caller a key names."""

    role: Role
    """What the key is."""
    runner_id: str | None = None
    """For a runner key, the runner id it is bound to."""
    rollout_id: str | None = None
    """For an agent key, the rollout it was minted for."""
    attempt: int | None = None
    """For an agent key, the attempt it was minted for."""


class AccessDenied(Exception):
    """A refused call: 401 (no key, an unknown or dead key) or 403 (a key without the
    right to this call)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    @property
    def kind(self) -> str:
        """The error `type` on the wire."""
        return "authentication_error" if self.status == 401 else "permission_error"


@dataclass(frozen=True)
class Keys:
    """The service's keys; with none configured, every call is allowed."""

    admin: str | None = None
    """The admin (trainer) key."""
    runners: Mapping[str, str] = field(default_factory=dict)
    """Runner id -> that runner's key."""
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    """Signs agent keys: derived from the admin key when there is one, else random."""

    @property
    def enabled(self) -> bool:
        """True when calls must carry a key."""
        return bool(self.admin or self.runners)

    @classmethod
    def load(cls, file: str | Path | None = None, env: Mapping[str, str] | None = None) -> Keys:
        """Keys from a TOML file (`admin = "..."`, `[runners] id = "..."`) and the
        environment (TRACERL_ADMIN_KEY, TRACERL_RUNNER_KEYS="id=key,id2=key2"); the
        environment wins for the admin key, runner keys are merged."""
        env = os.environ if env is None else env
        admin, runners = _from_file(file) if file else (None, {})
        admin = env.get("TRACERL_ADMIN_KEY") or admin
        runners = {**runners, **_runner_pairs(env.get("TRACERL_RUNNER_KEYS", ""))}
        if admin is None:
            return cls(None, runners)
        return cls(
            admin, runners, hashlib.sha256(b"tracerl agent keys\0" + admin.encode()).digest()
        )

    def agent_key(self, rollout_id: str, attempt: int) -> str:
        """The key of one claimed attempt (handed to its agent as api_key)."""
        return f"{AGENT_PREFIX}.{rollout_id}.{attempt}.{self._mac(rollout_id, attempt)}"

    def _mac(self, rollout_id: str, attempt: int) -> str:
        message = f"{rollout_id}\0{attempt}".encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def identify(self, key: str) -> Principal | None:
        """The principal a presented key names; None for a key nobody issued."""
        given = key.encode()
        if self.admin and hmac.compare_digest(given, self.admin.encode()):
            return Principal(Role.admin)
        # Every runner key is compared (no early exit), so timing says nothing of which.
        found = [rid for rid, k in self.runners.items() if hmac.compare_digest(given, k.encode())]
        if found:
            return Principal(Role.runner, runner_id=found[0])
        return self._agent(key)

    def _agent(self, key: str) -> Principal | None:
        prefix, _, rest = key.partition(".")
        rollout_id, _, rest = rest.partition(".")
        attempt, _, mac = rest.partition(".")
        if prefix != AGENT_PREFIX or not attempt.isdigit() or len(attempt) > 10:
            return None
        if not hmac.compare_digest(mac.encode(), self._mac(rollout_id, int(attempt)).encode()):
            return None
        return Principal(Role.agent, rollout_id=rollout_id, attempt=int(attempt))


def _from_file(path: str | Path) -> tuple[str | None, dict[str, str]]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"cannot read the keys file {path}: {e}") from None
    admin, runners = data.get("admin"), data.get("runners", {})
    if admin is not None and not isinstance(admin, str):
        raise ValueError(f"{path}: admin must be a string")
    if not isinstance(runners, dict) or not all(isinstance(v, str) for v in runners.values()):
        raise ValueError(f"{path}: [runners] must map runner ids to key strings")
    return admin, runners


def _runner_pairs(text: str) -> dict[str, str]:
    """'id=key,id2=key2' -> {id: key}; a key without 'id=' is named after its hash."""
    pairs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        rid, sep, key = item.partition("=")
        if not sep:
            rid, key = f"runner-{hashlib.sha256(item.encode()).hexdigest()[:8]}", item
        pairs[rid.strip()] = key.strip()
    return pairs


@functools.lru_cache(maxsize=256)  # asked of every request's Host header
def is_loopback(host: str) -> bool:
    """True when `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def key_of(request: Request) -> str | None:
    """The key a request presents: `Authorization: Bearer <key>` or `x-api-key: <key>`."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


# -- who may call which route ---------------------------------------------------------------


class Access(StrEnum):
    """Who may call a route (the admin may call every one)."""

    open = "open"
    """Anyone, no key."""
    agent = "agent"
    """The agent key of the rollout the call is for (path or X-Tracerl-Rollout)."""
    holder = "holder"
    """The runner holding the lease of the rollout in the path."""
    runner = "runner"
    """Any runner key."""
    admin = "admin"
    """The admin key only."""


ACCESS: dict[tuple[str, str], Access] = {
    ("GET", "/health"): Access.open,
    ("GET", "/openapi.json"): Access.open,
    ("GET", "/docs"): Access.open,
    ("GET", "/redoc"): Access.open,
    ("POST", "/rollouts/{rollout_id}/reward"): Access.agent,
    ("GET", "/store/tasks/{task_id}"): Access.runner,
    ("POST", "/store/claim"): Access.runner,
    ("GET", "/store/counts"): Access.runner,
    ("GET", "/store/versions/latest"): Access.runner,
    ("GET", "/store/rollouts/{rollout_id}"): Access.holder,
    ("POST", "/store/rollouts/{rollout_id}/heartbeat"): Access.holder,
    ("POST", "/store/rollouts/{rollout_id}/finish"): Access.holder,
    ("GET", "/store/rollouts/{rollout_id}/rewards"): Access.holder,
}
"""Routes open beyond the admin. Any other route is the admin's, except model calls: every
route under /rollouts/{rollout_id}/ and /v1/ (any API the gateway speaks) is its agent's."""


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(template)))


_RULES = [(method, _pattern(template), access) for (method, template), access in ACCESS.items()]
_MODEL_CALLS = re.compile(r"/rollouts/[^/]+/|/v1/")


def access_of(method: str, path: str) -> Access:
    """Who may call `method` on `path` (the request's own path: matched here against the
    table, so the answer never depends on how routers were mounted)."""
    method = "GET" if method == "HEAD" else method
    for rule_method, pattern, access in _RULES:
        if rule_method == method and pattern.fullmatch(path):
            return access
    return Access.agent if _MODEL_CALLS.match(path) else Access.admin


Lookup = Callable[[str], Awaitable[Rollout]]


@dataclass(frozen=True)
class Call:
    """What the guard reads of a request: its headers and path, never its body."""

    method: str
    """HTTP method (HEAD is checked as GET)."""
    path: str
    """The request's own path."""
    key: str | None
    """The key it presents (key_of)."""
    rollout_header: str | None
    """Its X-Tracerl-Rollout header."""

    @property
    def target(self) -> str | None:
        """The rollout the path names: /rollouts/<id>/... or /store/rollouts/<id>/..."""
        match = _TARGET.match(self.path)
        return match.group(1) if match else None


_TARGET = re.compile(r"^(?:/store)?/rollouts/([^/]+)(?:/|$)")


class KeysMiddleware:
    """Every route behind `keys`, checked from the request's headers before its body is
    read: an anonymous or unentitled caller uploading 60 MB is refused at the first byte,
    not after the last. The caller is left in `request.state.principal`; refusals are JSON
    in the shape of the API the path belongs to (tracerl.refusals)."""

    def __init__(
        self, app: ASGIApp, keys: Keys, store: Store | None, executor: Executor | None = None
    ) -> None:
        self.app = app
        self.keys = keys
        self.store = store
        self.executor = executor

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            principal = await self.principal(scope)
        except AccessDenied as e:
            headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
            await refuse(scope, send, Refusal(e.status, e.message, e.kind, headers=headers), True)
            return
        except NotFound as e:  # a holder's rollout that does not exist: 404 like any other
            await refuse(scope, send, Refusal(404, e.message, "NotFound"), close=True)
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)

    async def principal(self, scope: Scope) -> Principal:
        """The caller, or AccessDenied when it may not make this call."""
        if not self.keys.enabled:
            return Principal(Role.admin)
        request = Request(scope)  # headers only: its body is never asked for here
        rollout_header = request.headers.get(ROLLOUT_HEADER)
        call = Call(request.method, request.url.path, key_of(request), rollout_header)
        access = access_of(call.method, call.path)
        if access is Access.open:
            return Principal(Role.anonymous)
        if call.key is None:
            raise AccessDenied(401, "this call needs an API key (Authorization: Bearer ...)")
        principal = self.keys.identify(call.key)
        if principal is None:
            raise AccessDenied(401, "invalid API key")
        await _allow(principal, access, call, self._lookup)
        return principal

    async def _lookup(self, rollout_id: str) -> Rollout:
        if self.store is None:
            raise NotFound(f"no rollout {rollout_id!r}")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.store.get_rollout, rollout_id)


async def _allow(who: Principal, access: Access, call: Call, lookup: Lookup) -> None:
    """Raise AccessDenied unless `who` may make a call that needs `access`."""
    if who.role is Role.admin:
        return
    target = call.target
    if who.role is Role.agent:
        assert who.rollout_id is not None
        rollout = await _or_none(lookup, who.rollout_id)
        if rollout is None or rollout.status is not RolloutStatus.running:
            raise AccessDenied(401, "this agent key's attempt has ended")
        if rollout.attempt != who.attempt:
            raise AccessDenied(401, "this agent key's attempt has ended")
        target = target or call.rollout_header
        if access is not Access.agent or target != who.rollout_id:
            raise AccessDenied(403, f"an agent key serves only rollout {who.rollout_id!r}")
        return
    if access is Access.runner:
        return
    if access is Access.holder and target is not None:
        rollout = await lookup(target)  # NotFound: a 404 like any unknown rollout
        if rollout.status is RolloutStatus.running and rollout.runner_id == who.runner_id:
            return
        raise AccessDenied(403, f"runner {who.runner_id!r} holds no lease on {target!r}")
    raise AccessDenied(403, f"a runner key may not call {call.method} {call.path}")


async def _or_none(lookup: Lookup, rollout_id: str) -> Rollout | None:
    try:
        return await lookup(rollout_id)
    except NotFound:
        return None
