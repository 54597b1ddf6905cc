"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: `{"name": ..., "parameters": {...}}`.

The whole reply is the call (optionally after `<|python_tag|>`); several calls are
separated by `;`. Newer templates say "arguments": both keys are read. A reply that does
not start with a call is plain content, and so is one that is not entirely calls.
"""

from __future__ import annotations

from typing import Any

from tracerl.gateway.toolcalls.base import (
    Call,
    Literal,
    ToolFormat,
    as_call,
    json_objects,
    one_of_calls,
)

__all__ = ["LLAMA3"]

PYTHON_TAG = "<|python_tag|>"


def parse(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[Call]]:
    """([], the text) unless the reply is nothing but calls."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    values = json_objects(body)
    calls = [as_call(v, "parameters") for v in values or []]
    if not values or any(c is None for c in calls):
        return text, []
    return "", [c for c in calls if c is not None]


def grammar(tools: list[dict[str, Any]], literal: Literal, parallel: bool) -> str:
    """One call with "parameters" (or more when parallel, separated by '; ')."""
    more = ' ("; " call)*' if parallel else ""
    return "\n".join(
        [
            f"start: {literal(PYTHON_TAG)}? call{more}",
            f"call: {one_of_calls(tools, 'parameters')}",
        ]
    )


LLAMA3 = ToolFormat("llama3", (PYTHON_TAG,), (PYTHON_TAG, '{"name"'), parse, grammar)
