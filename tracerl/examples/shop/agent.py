"""A shopping agent with two tools, written against the public OpenAI client only: the
model looks up a unit price, multiplies with the calculator, and answers the total."""

from __future__ import annotations

import functools
import json
import re

import httpx
from openai import OpenAI

from . import tasks

SYSTEM_PROMPT = "Look up the price, calculate, answer the total."


def _tool(name: str, description: str, arg: str) -> dict:
    parameters = {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}
    return {"type": "function",
            "function": {"name": name, "description": description, "parameters": parameters}}  # fmt: skip


TOOLS = [
    _tool("price", "Unit price of an item.", "item"),
    _tool("calculator", "Multiply two integers: 'a*b'.", "expression"),
]
MAX_TURNS = 4


def price(item: str) -> str:
    """'<item>: <price> each', or 'unknown item'."""
    name = item.strip().lower().removesuffix("s")
    return f"{name}: {tasks.PRICES[name]} each" if name in tasks.PRICES else "unknown item"


def calculator(expression: str) -> str:
    """The product of 'a*b' (integers), or 'error'."""
    match = re.fullmatch(r"\s*(\d+)\s*\*\s*(\d+)\s*", expression)
    return str(int(match.group(1)) * int(match.group(2))) if match else "error"


def call_tool(name: str, arguments: str) -> str:
    """Run the tool the model called; bad calls come back as text."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return "error"
    if name == "price":
        return price(str(args.get("item", "")))
    if name == "calculator":
        return calculator(str(args.get("expression", "")))
    return "unknown tool"


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
            result = call_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""
