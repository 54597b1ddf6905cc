"""Qwen3-Coder tool calls: XML-style, one parameter per tag.

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is raw text; it becomes a string when the tool's schema says the parameter is one,
else the JSON it spells (a number, an object...) when it is valid JSON, else the text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tracerl.gateway.toolcalls.base import Call, Literal, ToolFormat, json_item

__all__ = ["QWEN3_CODER"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(<function=.*?</function>)\s*</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"^<function=([^>\n]+)>(.*)</function>$", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def parse(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[Call]]:
    """Content outside the well-formed blocks, and their calls in order."""
    types = _param_types(tools)
    calls: list[Call] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        call = _function(match.group(1), types)
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    return "".join(kept), calls


def _function(body: str, types: dict[str, dict[str, Any]]) -> Call | None:
    match = _FUNCTION.match(body.strip())
    if match is None:
        return None
    name, inner = match.group(1).strip(), match.group(2)
    # Anything between parameters but whitespace means the block is not what we think.
    if _PARAM.sub("", inner).strip():
        return None
    schema = types.get(name, {})
    args = {k.strip(): _value(v, schema.get(k.strip())) for k, v in _PARAM.findall(inner)}
    return {"name": name, "arguments": args}


def _value(raw: str, schema: Any) -> Any:
    # The template writes a newline after the opening tag and before the closing one.
    text = raw.removeprefix("\n").removesuffix("\n")
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _param_types(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Tool name -> {parameter: its JSON Schema}."""
    out = {}
    for tool in tools:
        fn = tool.get("function", tool)
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def grammar(tools: list[dict[str, Any]], literal: Literal, parallel: bool) -> str:
    """One call (or more when parallel); parameters in schema order, optional ones may be
    left out."""
    rules = [
        "start: call+" if parallel else "start: call",
        f'call: {literal(OPEN)} "\\n" function "\\n" {literal(CLOSE)}',
        "function: " + " | ".join(f"fn_{i}" for i in range(len(tools))),
        "TEXT: /[^<]*/",
    ]
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        items = []
        for j, (key, schema) in enumerate(props.items()):
            rule = f"p_{i}_{j}"
            value = "TEXT" if schema.get("type") == "string" else json_item(schema)
            rules.append(f'{rule}: "<parameter={key}>\\n" {value} "\\n</parameter>\\n"')
            items.append(rule if key in required else f"{rule}?")
        head = json.dumps(f"<function={fn['name']}>\n")
        rules.append(f'fn_{i}: {head} {" ".join(items)} "</function>"')
    return "\n".join(rules)


QWEN3_CODER = ToolFormat(
    "qwen3_coder",
    (OPEN, CLOSE, "<function=", "</function>", "<parameter=", "</parameter>"),
    (OPEN,),
    parse,
    grammar,
)
