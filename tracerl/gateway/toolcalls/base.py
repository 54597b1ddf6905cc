"""What every tool-call format shares: the parsed reply, the format record, JSON helpers.

A format knows three things about one model family's convention: the marker text it writes
around calls (kept in the decoded text so the parser sees it, hidden from the agent
otherwise), how to split a finished reply into content and calls, and the grammar that
makes a constrained decoder write one or more well-formed calls (tool_choice "required" or
a named tool).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, JsonValue

__all__ = [
    "COMPACT_JSON",
    "Call",
    "Literal",
    "json_item",
    "one_of_calls",
    "ParsedReply",
    "ToolFormat",
    "call_schema",
    "json_objects",
]

Call = dict[str, JsonValue]
"""One parsed call in canonical form: {"name": str, "arguments": dict}."""

COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How forced JSON is spaced: as json.dumps writes it. Free whitespace would let a weak
model pad a value with blanks until max_tokens runs out."""

Literal = Callable[[str], str]
"""Renders a marker as a grammar literal: a special token by id when the tokenizer has it
as one token, else the quoted text (see enforce.literal)."""


class ParsedReply(BaseModel):
    """The model's text split into OpenAI message parts."""

    content: str
    """Text outside tool calls and reasoning, stripped."""
    tool_calls: list[Call]
    """Calls in canonical form (arguments as dicts); [] when none parsed."""
    reasoning: str = ""
    """The model's reasoning (between its thinking markers), stripped; '' when none."""


@dataclass(frozen=True)
class ToolFormat:
    """One model family's tool-call convention."""

    name: str
    """The `tool_parser` setting that selects it (hermes, qwen3_coder, llama3, mistral)."""
    markers: tuple[str, ...]
    """Marker text of the format: kept in the decoded text even when a special token."""
    opens: tuple[str, ...]
    """Text that begins the calls: a streamed reply's content stops where one appears."""
    parse: Callable[[str, list[dict[str, Any]]], tuple[str, list[Call]]]
    """(text, tools) -> (content left, calls); text it cannot read stays in the content."""
    grammar: Callable[[list[dict[str, Any]], Literal, bool], str]
    """(tools, literal, parallel) -> a Lark grammar whose `start` is one call of the tools,
    or (parallel) one or more."""


def call_schema(tool: dict[str, Any], key: str = "arguments") -> dict[str, Any]:
    """JSON Schema of one call object {"name": <the tool's name>, key: <its arguments>}."""
    fn = tool.get("function", tool)
    params = fn.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, key: params},
        "required": ["name", key],
        "additionalProperties": False,
    }


def one_of_calls(tools: list[dict[str, Any]], key: str = "arguments") -> str:
    """A `%json` grammar item accepting a call object of any of the tools."""
    schemas = [call_schema(t, key) for t in tools]
    return json_item(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})


def json_item(schema: dict[str, Any]) -> str:
    """A Lark `%json` item for the schema, spaced compactly (COMPACT_JSON)."""
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT_JSON})


def json_objects(text: str, separators: str = " \t\n;,") -> list[Any] | None:
    """The JSON values `text` is made of, one after another (separated by whitespace or any
    of `separators`); None when anything else is in it."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    at = 0
    while True:
        while at < len(text) and text[at] in separators:
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        values.append(value)


def as_call(value: Any, key: str = "arguments") -> Call | None:
    """{"name": str, key: dict or JSON-object string} as a canonical call, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(key, value.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": value["name"], "arguments": args}
