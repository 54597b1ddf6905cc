"""Mistral tool calls: `[TOOL_CALLS]` and then the calls.

Two spellings exist: a JSON list `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
(Mistral 7B v0.3, Nemo, Small 3) and, from tokenizer v11 on, one `[TOOL_CALLS]NAME{...}`
(or `[TOOL_CALLS]NAME[ARGS]{...}`) per call. Both are read; the constrained grammar writes
the list. Content before the first marker is kept; unreadable calls leave the text whole.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tracerl.gateway.toolcalls.base import (
    Call,
    Literal,
    ToolFormat,
    as_call,
    call_schema,
    json_item,
    json_objects,
)

__all__ = ["MISTRAL"]

MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAMED = re.compile(r"^\s*([A-Za-z0-9_.-]{1,64})\s*(?:\[ARGS\])?\s*(\{.*\})\s*$", re.DOTALL)


def parse(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[Call]]:
    """Content before the first marker, and the calls after it (none if any is unreadable)."""
    at = text.find(MARK)
    if at < 0:
        return text, []
    parts = text[at:].split(MARK)[1:]
    calls = _listed(parts[0]) if len(parts) == 1 else None
    if calls is None:
        calls = [_named(p) for p in parts]
    if not calls or any(c is None for c in calls):
        return text, []
    return text[:at], [c for c in calls if c is not None]


def _listed(body: str) -> list[Call | None] | None:
    """The pre-v11 list (or a bare object); None when the body is not one."""
    values = json_objects(body.strip())
    if not values or len(values) != 1:
        return None
    value = values[0]
    items = value if isinstance(value, list) else [value]
    return [as_call(v) for v in items] if items else None


def _named(body: str) -> Call | None:
    """A v11 `NAME{...}` call."""
    match = _NAMED.match(body)
    if match is None:
        return None
    try:
        args = json.loads(match.group(2))
    except json.JSONDecodeError:
        return None
    return as_call({"name": match.group(1), "arguments": args})


def grammar(tools: list[dict[str, Any]], literal: Literal, parallel: bool) -> str:
    """The marker and a JSON list of one call (or more when parallel)."""
    items = [call_schema(t) for t in tools]
    one = items[0] if len(items) == 1 else {"anyOf": items}
    schema = {"type": "array", "minItems": 1, "items": one}
    if not parallel:
        schema["maxItems"] = 1
    return f"start: {literal(MARK)} calls\ncalls: {json_item(schema)}"


MISTRAL = ToolFormat("mistral", (MARK, ARGS), (MARK,), parse, grammar)
