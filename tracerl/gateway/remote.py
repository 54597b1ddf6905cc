"""A frozen role served by any OpenAI-compatible URL: the gateway forwards and records text.

The agent's chat request goes on as it was sent, with `model` swapped for the name the
remote server knows and streaming off (the gateway streams the finished reply itself, so
the recorded span is the whole reply). The reply comes back under the gateway's own id, so
an X-Tracerl-Parent naming a remote call nests sub-agents the same way as a local one.
The span holds the messages and the reply but no token ids: a remote model's tokens are not
ours to train, so the role is recorded and never trained. Given a local `tokenizer`, the
calls are recorded as that tokenizer's ids as well (gateway/distill.py): a teacher's calls
become a student's supervised rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import httpx

from tracerl.roles import ReplyFormat

__all__ = ["RemoteError", "RemoteModel"]


class RemoteError(Exception):
    """The remote server could not be reached or did not answer a chat completion."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass
class RemoteModel:
    """A role (model name) answered by an OpenAI-compatible server elsewhere."""

    name: str
    """The `model` agents ask for; the role recorded on spans."""
    url: str
    """Base URL of the server, up to and including /v1 (e.g. http://host:8000/v1)."""
    model: str
    """The model name the remote server knows."""
    api_key_env: str | None = None
    """Environment variable holding the API key sent as a bearer token (keys stay out of
    config files); None sends no key."""
    tokenizer: str | None = None
    """A local model dir whose tokenizer and chat template also record the calls as token
    ids (a student's, for `tracerl sft --from-traces`); None records text only."""
    reply: ReplyFormat = ReplyFormat()
    """With `tokenizer`: how the encoded reply is read back (its tool-call format and
    reasoning markers; unset parts read off that tokenizer's chat template)."""
    timeout_s: float = 120.0
    """Seconds to wait for one reply."""
    _client: httpx.AsyncClient | None = field(default=None, init=False, repr=False)

    def _headers(self) -> dict[str, str]:
        if self.api_key_env is None:
            return {}
        key = os.environ.get(self.api_key_env)
        if not key:
            raise RemoteError(
                500,
                f"role {self.name!r}: environment variable {self.api_key_env} holds no API key",
                "remote_key_missing",
            )
        return {"Authorization": f"Bearer {key}"}

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST the request to url/chat/completions; the reply as a dict."""
        payload = {**body, "model": self.model, "stream": False}
        payload.pop("stream_options", None)
        target = f"{self.url.rstrip('/')}/chat/completions"
        if self._client is None:  # made on first use, inside the gateway's event loop
            self._client = httpx.AsyncClient(timeout=self.timeout_s)
        try:
            resp = await self._client.post(target, json=payload, headers=self._headers())
        except httpx.HTTPError as e:
            raise RemoteError(
                502, f"role {self.name!r}: {target} unreachable: {e!r}", "remote_unreachable"
            ) from None
        if resp.status_code >= 400:
            # The agent's mistake (4xx) keeps its status; the remote server's own is a 502.
            status = resp.status_code if resp.status_code < 500 else 502
            raise RemoteError(
                status,
                f"role {self.name!r}: {target} answered {resp.status_code}: {_message(resp)}",
                "remote_error",
            )
        return _reply(self.name, target, resp)

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _message(resp: httpx.Response) -> str:
    """The error message of an OpenAI-style error body, else the start of the text."""
    try:
        error = resp.json().get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    except (ValueError, AttributeError):
        pass
    return resp.text[:500]


def _reply(name: str, target: str, resp: httpx.Response) -> dict[str, Any]:
    try:
        data = resp.json()
        choices = data["choices"]
        if not choices or not all(isinstance(c.get("message"), dict) for c in choices):
            raise ValueError("choices without messages")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RemoteError(
            502, f"role {name!r}: {target} did not answer a chat completion: {e}", "remote_error"
        ) from None
    assert isinstance(data, dict)
    return data
