"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Each call is one tagged JSON object (real templates put a newline inside the tags; the tiny
model writes none), or a block holds a JSON list of them (SmolLM2's own convention);
content may come before, between or after the calls. A block that is not valid JSON of that
shape stays in the content: the agent sees what the model wrote.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tracerl.gateway.toolcalls.base import Call, Literal, ToolFormat, as_call, one_of_calls

__all__ = ["HERMES"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def parse(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[Call]]:
    """Content outside the well-formed blocks, and their calls in order."""
    calls: list[Call] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        block = _block(match.group(1))
        if block is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls += block
    kept.append(text[last:])
    return "".join(kept), calls


def _block(body: str) -> list[Call] | None:
    """The calls of one block: a call object, or a non-empty list of them; None otherwise."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    calls = [as_call(v) for v in (value if isinstance(value, list) else [value])]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def grammar(tools: list[dict[str, Any]], literal: Literal, parallel: bool) -> str:
    """One tagged call (or more when parallel), newlines inside the tags optional."""
    return "\n".join(
        [
            "start: call+" if parallel else "start: call",
            f'call: {literal(OPEN)} "\\n"? body "\\n"? {literal(CLOSE)}',
            f"body: {one_of_calls(tools)}",
        ]
    )


HERMES = ToolFormat("hermes", (OPEN, CLOSE), (OPEN,), parse, grammar)
