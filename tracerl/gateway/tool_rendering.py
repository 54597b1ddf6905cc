"""How a request's tools reach a model whose chat template ignores them.

Many instruct models' templates have no tool support (SmolLM2's ChatML renders role and
content only): given `tools`, they render the same prompt as without, and an assistant
turn's tool calls vanish from the history. A request's tools must never be dropped
silently, so for such a template the gateway rewrites the conversation the Hermes way (the
convention of ChatML models, Qwen2.5's template spelled out) before the template renders
it:

- the tools, one JSON object a line inside `<tools></tools>`, with how to call them, are
  appended to the system message (or are the system message when there is none);
- an assistant turn's calls become its text: `<tool_call>\\n{"name": ..., "arguments":
  ...}\\n</tool_call>` after its content, one block per call;
- tool results become one user turn of `<tool_response>\\n...\\n</tool_response>` blocks
  (consecutive results share it).

Replies are then parsed with the Hermes parser. The rewrite is a function of each message
and of the messages before it only, so rendering a conversation's prefix gives a prefix of
the whole: token-in/token-out holds across turns as it does with a template's own rendering.

Whether a template ignores tools is probed once per tokenizer: a conversation is rendered
with and without a probe tool, and with a probe call and result; a template whose output
lacks any of them gets the rewrite. A template that raises on the probe is left to render
as it does (it may demand its own id format; the request's errors say so then).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Literal

from pydantic import JsonValue

__all__ = ["ToolRendering", "hermes_messages", "probe_rendering", "uses_tools"]

ToolRendering = Literal["template", "hermes-fallback"]
"""How tools reach the prompt: the chat template's own rendering, or the Hermes rewrite."""

Message = dict[str, JsonValue]
Render = Callable[[list[Message], list[dict] | None, bool], str]
"""(messages, tools, add_generation_prompt) -> the template's text."""

_PROBE = "tracerl_probe_tool"
_PROBE_ARG = "tracerl-probe-argument"
_PROBE_RESULT = "tracerl-probe-result"
_PROBE_TOOLS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": _PROBE,
            "description": "probe",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }
]
_PROBE_CALL: list[Message] = [
    {"role": "user", "content": "probe"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                # Nine alphanumerics: the strictest id format a template demands (Mistral).
                "id": "probe0001",
                "type": "function",
                "function": {"name": _PROBE, "arguments": {"x": _PROBE_ARG}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "probe0001", "name": _PROBE, "content": _PROBE_RESULT},
]

_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def probe_rendering(render: Render) -> ToolRendering:
    """ "template" when the template shows a tool, a call and its result; else the
    Hermes rewrite."""
    try:
        plain = render(_PROBE_CALL[:1], None, True)
        with_tools = render(_PROBE_CALL[:1], _PROBE_TOOLS, True)
        history = render(_PROBE_CALL, _PROBE_TOOLS, False)
    except Exception:  # a template with demands of its own renders as it does
        return "template"
    shown = with_tools != plain and _PROBE in with_tools
    kept = all(s in history for s in (_PROBE, _PROBE_ARG, _PROBE_RESULT))
    return "template" if shown and kept else "hermes-fallback"


def uses_tools(messages: list[Message], tools: list[dict] | None) -> bool:
    """Whether a request involves tools: tools given, or calls or results in its history."""
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def hermes_messages(messages: list[Message], tools: list[dict] | None) -> list[Message]:
    """The conversation rewritten so that a template without tool support shows its tools,
    calls and results the Hermes way (the module doc gives the shape)."""
    out: list[Message] = []
    if tools:
        block = _INSTRUCTIONS.format(tools="\n".join(json.dumps(t) for t in tools))
        first = messages[0] if messages else None
        if first is not None and first.get("role") == "system":
            out.append({"role": "system", "content": f"{first['content']}\n\n{block}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for m in messages:
        if m.get("role") == "tool":
            response = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            last = out[-1] if out else None
            if last is not None and last.get("tool_responses"):
                last["content"] = f"{last['content']}\n{response}"
            else:
                # Marked so the next result joins it; the mark is dropped below.
                out.append({"role": "user", "content": response, "tool_responses": True})
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": _with_calls(m)})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("tool_responses", None)
    return out


def _with_calls(message: Message) -> str:
    """An assistant turn's text: its content, then one <tool_call> block per call."""
    calls = message.get("tool_calls")
    assert isinstance(calls, list)
    blocks = []
    for call in calls:
        assert isinstance(call, dict) and isinstance(call["function"], dict)
        fn = call["function"]
        body = json.dumps({"name": fn["name"], "arguments": fn.get("arguments", {})})
        blocks.append(f"<tool_call>\n{body}\n</tool_call>")
    content = str(message.get("content") or "")
    return "\n".join([content, *blocks] if content else blocks)
