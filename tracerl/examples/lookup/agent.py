"""A lookup agent written against the public OpenAI client only: it searches a local
corpus of towns with a `search` tool, then answers with the number it found."""

from __future__ import annotations

import functools
import json

import httpx
from openai import OpenAI

from . import tasks

SYSTEM_PROMPT = "Search the town, then answer with the number."
TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Facts about a town.",
    "parameters": {"type": "object", "properties": {"town": {"type": "string"}},
                   "required": ["town"]}}}]  # fmt: skip
MAX_TURNS = 3


def search(town: str) -> str:
    """The corpus entry of `town` (case-insensitive), or 'no result'."""
    for name, facts in tasks.CORPUS.items():
        if name.lower() == town.strip().lower():
            return f"{name}: population {facts['population']}, altitude {facts['altitude']}"
    return "no result"


@functools.cache
def _http() -> httpx.Client:
    return httpx.Client(timeout=60.0, limits=httpx.Limits(max_connections=256))


def run(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    """Answer one question ({"question": ...}); returns the final answer text."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=_http())
    messages: list = [{"role": "system", "content": SYSTEM_PROMPT},
                      {"role": "user", "content": task["question"]}]  # fmt: skip
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=32
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return (message.content or "").strip()
        for call in message.tool_calls:
            try:
                town = str(json.loads(call.function.arguments).get("town", ""))
            except (json.JSONDecodeError, AttributeError):
                town = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": search(town)})
    return ""
