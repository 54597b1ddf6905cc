"""The chat template of tracerl's tiny model, its special tokens, and the tool-call text.

One Jinja template renders system / user / assistant (with tool calls) / tool turns. It is
prefix-stable: rendering a conversation prefix (add_generation_prompt=False) gives a string
prefix of rendering the longer conversation, which the gateway's token-in/token-out relies
on. Tool-call arguments should be dicts (the gateway normalises them); a JSON string is
emitted verbatim, which is the same text when it was written by json.dumps with default
separators (Jinja has no JSON parser to normalise it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import cast

from transformers.utils.chat_template_utils import render_jinja_template

__all__ = [
    "ASSISTANT",
    "CHAT_TEMPLATE",
    "END",
    "PAD",
    "SPECIAL_TOKENS",
    "SYSTEM",
    "TOOL",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "USER",
    "format_tool_call",
    "render_chat",
]

PAD = "<|pad|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
TOOL = "<|tool|>"
END = "<|end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# Order fixes their ids (0..7) in a freshly trained tokenizer.
SPECIAL_TOKENS = [PAD, SYSTEM, USER, ASSISTANT, TOOL, END, TOOL_CALL_START, TOOL_CALL_END]

# Every literal that must survive sits inside {{ '...' }}: transformers renders with
# trim_blocks/lstrip_blocks, and whitespace between tags would be eaten or leak. A message's
# content may be a string, None, or a list of OpenAI text parts.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro tools_line() -%}"
    "{{ 'Tools: ' }}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool['function'] if tool['function'] is defined else tool -%}"
    "{%- set params = fn['parameters'] if fn['parameters'] is defined else {} -%}"
    "{%- set props = params['properties'] if params['properties'] is defined else {} -%}"
    "{{ fn['name'] ~ '(' ~ (props | join(',')) ~ ')' }}"
    "{%- if not loop.last -%}{{ '; ' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endmacro -%}"
    "{%- macro tool_call(call) -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string "
    "else (fn['arguments'] | tojson) -%}"
    "{{ '<tool_call>{\"name\": ' ~ (fn['name'] | tojson) ~ ', \"arguments\": ' ~ args"
    " ~ '}</tool_call>' }}"
    "{%- endmacro -%}"
    "{%- if tools and messages[0]['role'] != 'system' -%}"
    "{{ '<|system|>' ~ tools_line() ~ '<|end|>' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{ '<|system|>' ~ text(message['content']) }}"
    "{%- if tools -%}{{ '\\n' ~ tools_line() }}{%- endif -%}"
    "{{ '<|end|>' }}"
    "{%- elif message['role'] == 'user' -%}"
    "{{ '<|user|>' ~ text(message['content']) ~ '<|end|>' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<|assistant|>' ~ text(message['content']) }}"
    "{%- for call in message['tool_calls'] or [] -%}{{ tool_call(call) }}{%- endfor -%}"
    "{{ '<|end|>' }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{ '<|tool|>' ~ text(message['content']) ~ '<|end|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


def format_tool_call(name: str, arguments: Mapping[str, object]) -> str:
    """The exact text the model emits for one tool call (what the template renders)."""
    return f"{TOOL_CALL_START}{json.dumps({'name': name, 'arguments': dict(arguments)})}{TOOL_CALL_END}"


def render_chat(
    messages: Sequence[Mapping[str, object]],
    tools: Sequence[Mapping[str, object]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """CHAT_TEMPLATE rendered without a tokenizer, exactly as apply_chat_template renders it
    (e.g. to get the texts a new tokenizer is trained on)."""
    # Typed as str upstream, but it returns (renders, generation indices).
    rendered, _ = cast(
        tuple[list[str], list],
        render_jinja_template(
            conversations=[[dict(m) for m in messages]],
            tools=[dict(t) for t in tools] if tools else None,
            chat_template=CHAT_TEMPLATE,
            add_generation_prompt=add_generation_prompt,
        ),
    )
    return rendered[0]
