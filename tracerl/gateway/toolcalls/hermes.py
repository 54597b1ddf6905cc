"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Each call is one tagged JSON object (real templates put a newline inside the tags; the tiny
model writes none); content may come before, between or after the calls. A block that is
not valid JSON of that shape stays in the content: the agent sees what the model wrote.
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
        call = _block(match.group(1))
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    return "".join(kept), calls


def _block(body: str) -> Call | None:
    try:
        return as_call(json.loads(body))
    except json.JSONDecodeError:
        return None


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
