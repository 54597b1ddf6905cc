"""How tracerl's engine client speaks HTTP to engine servers: how long connections live,
what counts as a failed connection, and what a server's answer means.

A connection can fail while its server is fine (the server closed an idle pooled connection
as a call went out on it), so a failed connection alone never condemns a replica: `alive`
asks the server itself, on a fresh connection.
"""

from __future__ import annotations

from typing import Any

import httpx

__all__ = ["CONNECTION_ERRORS", "KEEPALIVE_S", "SERVER_KEEPALIVE_S", "alive", "answer"]

KEEPALIVE_S = 2.0
"""How long an idle pooled connection is reused: well under the servers' keep-alive (the
transformers server's and vLLM's are set to SERVER_KEEPALIVE_S), so the client never sends
on a connection the server is closing."""
SERVER_KEEPALIVE_S = 30
"""How long the engine servers tracerl starts keep an idle connection open."""
CONNECTION_ERRORS = (httpx.TransportError, AttributeError)
"""What a failed connection raises. AttributeError: anyio reads the peer name of a socket that
a closing server has already dropped (`'NoneType' object has no attribute 'getpeername'`)
while httpcore opens a connection."""


async def alive(url: str) -> bool:
    """Whether the server at `url` answers /health now, on a fresh connection."""
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            return (await client.get(f"{url}/health")).status_code == 200
    except CONNECTION_ERRORS:
        return False


def answer(response: httpx.Response) -> dict[str, Any]:
    """The body of a successful answer; a 4xx becomes ValueError, anything else an error."""
    if response.status_code == 200:
        return dict(response.json())
    message = response.text
    if 400 <= response.status_code < 500:
        raise ValueError(f"the server refused the request ({response.status_code}): {message}")
    raise RuntimeError(f"the server failed ({response.status_code}): {message}")
