"""An extraction agent written against the public OpenAI client only: the model reads a
record with the `read` tool and answers with a JSON object {"name", "age"}."""

from __future__ import annotations

import functools
import json

import httpx
from openai import OpenAI

from . import tasks

SYSTEM_PROMPT = 'Read the record, then answer {"name": ..., "age": ...}.'
TOOLS = [{"type": "function", "function": {
    "name": "read", "description": "The text of a record.",
    "parameters": {"type": "object", "properties": {"record": {"type": "string"}},
                   "required": ["record"]}}}]  # fmt: skip
MAX_TURNS = 3


def read(record: str) -> str:
    """The record as prose, or 'no such record'."""
    person = tasks.RECORDS.get(record.strip().upper())
    if person is None:
        return "no such record"
    return f"{person['name']} is {person['age']} and lives in {person['town']}."


@functools.cache
def _http() -> httpx.Client:
    return httpx.Client(timeout=60.0, limits=httpx.Limits(max_connections=256))


def run(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    """Extract one record ({"question": ...}); returns the final answer text (JSON)."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=_http())
    messages: list = [{"role": "system", "content": SYSTEM_PROMPT},
                      {"role": "user", "content": task["question"]}]  # fmt: skip
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=40
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return (message.content or "").strip()
        for call in message.tool_calls:
            try:
                record = str(json.loads(call.function.arguments).get("record", ""))
            except (json.JSONDecodeError, AttributeError):
                record = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": read(record)})
    return ""
