"""The model's reply text as OpenAI message parts, in the convention of its family.

Each served model has one tool-call format (`ToolFormat`): its `tool_parser` setting names
it, else it is read off the chat template (`detect`), else Hermes. Parsing only shapes the
response the agent gets; the span keeps the model's own token ids.
"""

from __future__ import annotations

from typing import Any

from tracerl.gateway.toolcalls.base import Call, ParsedReply, ToolFormat
from tracerl.gateway.toolcalls.hermes import HERMES
from tracerl.gateway.toolcalls.llama3 import LLAMA3
from tracerl.gateway.toolcalls.mistral import MISTRAL
from tracerl.gateway.toolcalls.qwen3_coder import QWEN3_CODER
from tracerl.gateway.toolcalls.reasoning import Reasoning, split_reasoning

__all__ = [
    "FORMATS",
    "Call",
    "ParsedReply",
    "Reasoning",
    "ToolFormat",
    "detect",
    "detect_reasoning",
    "parse_reply",
    "tool_format",
]

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, QWEN3_CODER, LLAMA3, MISTRAL)}
"""Every format, by its `tool_parser` name."""

# What in a chat template gives its family away, most specific first: Qwen3-Coder's
# template also writes <tool_call>, and Llama's speaks of "parameters" as others may.
_SIGNS = [
    ("<function=", QWEN3_CODER),
    ("[TOOL_CALLS]", MISTRAL),
    ("<tool_call>", HERMES),
    ("<|python_tag|>", LLAMA3),
    ('"parameters"', LLAMA3),
]


def tool_format(name: str | None, chat_template: Any) -> ToolFormat:
    """The format called `name`, else the one the template is written for."""
    if name is None:
        return detect(chat_template)
    if name not in FORMATS:
        raise ValueError(f"unknown tool_parser {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


def detect(chat_template: Any) -> ToolFormat:
    """The format a chat template writes tool calls in; Hermes when it gives no sign."""
    text = _template_text(chat_template)
    for sign, fmt in _SIGNS:
        if sign in text:
            return fmt
    return HERMES


def detect_reasoning(chat_template: Any, generation_prompt: str) -> Reasoning | None:
    """`<think>` markers when the template knows them; `generation_prompt` is the template
    rendered up to the assistant's turn (does it open the reasoning itself?)."""
    if "<think>" not in _template_text(chat_template):
        return None
    return Reasoning(open_in_prompt=generation_prompt.rstrip().endswith("<think>"))


def parse_reply(
    text: str,
    tools: list[dict[str, Any]] | None,
    fmt: ToolFormat = HERMES,
    reasoning: Reasoning | None = None,
) -> ParsedReply:
    """Reasoning, content and calls of a reply; calls only when the request gave tools.
    When no call can be read, the whole text (markers and all) is the content."""
    thought, rest = split_reasoning(text, reasoning)
    calls: list[Call] = []
    if tools is not None:
        content, calls = fmt.parse(rest, tools)
    if not calls:
        content = rest
    return ParsedReply(content=content.strip(), tool_calls=calls, reasoning=thought)


def _template_text(chat_template: Any) -> str:
    """A template's text; tokenizers with several named templates give a dict of them."""
    if isinstance(chat_template, dict):
        return "\n".join(str(t) for t in chat_template.values())
    return chat_template or ""
