"""An asset's text in a request's system message: appended to it, or replacing it; a system
message is added first when the request has none.

Pure and deterministic: the same messages and assets give the same result every call, so a
rollout's next request, extended by the agent, still extends the previous prompt token for
token (the gateway's token-in/token-out reuse holds with assets applied).
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["APPEND_SEPARATOR", "Mode", "with_assets"]

Mode = Literal["append", "replace"]
"""How an asset meets the system message: after its text, or instead of it."""

APPEND_SEPARATOR = "\n\n"
"""Between the system message and an appended asset."""

_SYSTEM = ("system", "developer")


def with_assets(
    messages: list[dict[str, Any]], texts: list[tuple[str, Mode]]
) -> list[dict[str, Any]]:
    """`messages` with each (text, mode) applied to the first message in order: appended to
    it or replacing it when that is a system (or developer) message, else to a new system
    message put first. The input is not changed."""
    if not texts:
        return messages
    out = list(messages)
    if out and out[0].get("role") in _SYSTEM:
        first = dict(out[0])
    else:
        first = {"role": "system", "content": ""}
        out.insert(0, first)
    for text, mode in texts:
        first["content"] = _joined(first.get("content"), text, mode)
    out[0] = first
    return out


def _joined(content: Any, text: str, mode: Mode) -> Any:
    """Content with the asset applied: a string, or a list of text parts kept a list."""
    if mode == "replace":
        return text
    if isinstance(content, list):
        separator = APPEND_SEPARATOR if content else ""
        return [*content, {"type": "text", "text": separator + text}]
    if not content:
        return text
    return f"{content}{APPEND_SEPARATOR}{text}"
