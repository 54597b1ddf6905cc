"""What is checked at a tracerl server's door, before any route runs: what a web page may
not make it do (DoorsMiddleware, here), then the caller's key (auth.py), then the body's
size and arrival (limits.py). `guard_app` puts an app behind the three in that order, each
refusing from what it has read so far; the dashboard has the first only.

A server on loopback without keys serves whoever reaches it, and every web page the user
opens reaches it too: the page's scripts may send "simple" cross-origin requests (a
text/plain POST needs no CORS preflight) and, by DNS rebinding (a name of the attacker's
that resolves to 127.0.0.1 a moment later), even read the answers. So, in this order:

- Host: without keys, only loopback names (localhost, 127.0.0.0/8, ::1) and the names the
  server was told it listens on are served (400 otherwise): a rebound name is refused before
  any route runs. With keys, every caller presents one, so Host may name anything (runners
  reach a cluster's gateway by whatever name their network gives it).
- Origin: browsers name the page's origin on every cross-origin request and every POST; one
  that is not this server's own (scheme://<its Host>) is refused (403), keys or not. Other
  clients (SDKs, runners, curl) send none and are not asked for one.
- Content-Type: a request that carries a body must declare it JSON (application/json or
  application/<x>+json; 415 otherwise), so no form or text/plain body is taken for JSON.

Starlette's TrustedHostMiddleware would do the Host part, but it refuses in plain text, not
in the API's JSON error shape, and it takes a list of names where loopback is a range.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from concurrent.futures import Executor
from urllib.parse import urlsplit

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from tracerl.auth import Keys, KeysMiddleware, is_loopback
from tracerl.limits import Limits, LimitsMiddleware
from tracerl.refusals import Refusal, refuse
from tracerl.store import Store

__all__ = ["DoorsMiddleware", "guard_app", "host_name", "same_origin"]


def guard_app(
    app: FastAPI,
    keys: Keys,
    limits: Limits,
    store: Store | None,
    executor: Executor | None,
    hosts: Collection[str] = (),
) -> None:
    """Put `app` behind its doors (Host, Origin, Content-Type), then its keys (checked from
    the headers), then its limits (the body, read last); each refuses before the next runs.
    Without keys, Host names other than loopback ones and `hosts` are refused."""
    app.add_middleware(LimitsMiddleware, limits=limits)  # the innermost: added first
    app.add_middleware(KeysMiddleware, keys=keys, store=store, executor=executor)
    app.add_middleware(DoorsMiddleware, hosts=None if keys.enabled else hosts)


_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


class DoorsMiddleware:
    """Refuses what only a browser tricked by a web page would send (module docstring)."""

    def __init__(self, app: ASGIApp, hosts: Collection[str] | None = ()) -> None:
        self.app = app
        self.hosts = None if hosts is None else frozenset(h.lower().strip("[]") for h in hosts)
        """Host names served besides loopback ones; None: any name (keys are set)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.check(scope)
        if refusal is not None:
            await refuse(scope, send, refusal, close=True)  # the body is never read
            return
        await self.app(scope, receive, send)

    def check(self, scope: Scope) -> Refusal | None:
        """Why the request is refused, or None."""
        headers = Headers(scope=scope)
        host = headers.get("host")
        if host is not None and self.hosts is not None and not _served(host, self.hosts):
            message = f"this server answers to loopback names only, not {host!r} (no keys set)"
            return Refusal(400, message, code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not same_origin(origin, host):
            message = f"requests from the web page at {origin} are refused (not this origin)"
            return Refusal(403, message, "permission_error", code="origin_not_allowed")
        if scope["method"] in _BODY_METHODS and not _json_or_none(headers):
            kind = headers.get("content-type", "no content type")
            message = f"request bodies must be application/json, not {kind}"
            return Refusal(415, message, code="unsupported_media_type")
        return None


@functools.lru_cache(maxsize=256)  # asked of every request: its Host header, parsed once
def _served(host: str, names: frozenset[str] | None) -> bool:
    """Whether a Host header names this server: a loopback name, or one of `names`."""
    name = host_name(host)
    return name is not None and (is_loopback(name) or name in (names or ()))


def host_name(host: str) -> str | None:
    """The name of a Host header ("[::1]:8000" -> "::1"); None when it cannot be read."""
    try:
        name = urlsplit(f"//{host}").hostname
    except ValueError:
        return None
    return name or None


def same_origin(origin: str, host: str | None) -> bool:
    """Whether `origin` (scheme://name[:port]) is the server the Host header names."""
    try:
        page = urlsplit(origin)
        here = urlsplit(f"{page.scheme}://{host}")
        page_port = page.port or _DEFAULT_PORTS.get(page.scheme)
        here_port = here.port or _DEFAULT_PORTS.get(page.scheme)
    except ValueError:  # "null" (a sandboxed or file: page), or garbage
        return False
    if host is None or page.scheme not in _DEFAULT_PORTS or not page.hostname:
        return False
    return page.hostname == here.hostname and page_port == here_port


def _json_or_none(headers: Headers) -> bool:
    """Whether the request sends no body, or declares its body JSON."""
    kind = headers.get("content-type")
    if kind is None:
        length = headers.get("content-length")
        return "transfer-encoding" not in headers and length in (None, "0")
    media = kind.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )
