"""A scripted teacher served as an OpenAI-compatible model: it knows nothing of tracerl.

It answers /v1/chat/completions the way a strong model would answer the calculator agent:
after a tool result it answers with that result; otherwise it either calls the calculator
on the question's arithmetic or, with probability 1 - `tool_rate`, works the answer out
in its head and answers directly. Always right, so every rollout earns reward 1. A small
student imitating the teacher learns both habits, and it cannot do arithmetic in its head:
it ends up knowing the tool and under-using it, the start RL improves from rewards alone.
Usage: python teacher.py [--port 8011] [--tool-rate 0.4] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI


def _expression(question: str) -> str:
    """The arithmetic inside 'What is 37+48?'."""
    match = re.search(r"-?\d+\s*[-+*]\s*-?\d+", question)
    return match.group(0).replace(" ", "") if match else question


def _value(expression: str) -> str:
    a, op, b = re.fullmatch(r"(-?\d+)([-+*])(-?\d+)", expression).groups()  # type: ignore[union-attr]
    x, y = int(a), int(b)
    return str({"+": x + y, "-": x - y, "*": x * y}[op])


def _text(content: Any) -> str:
    """A message's content as text (a string or a list of text parts)."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def reply(messages: list[dict], tool_rate: float, seed: int) -> dict:
    """The teacher's assistant message for a conversation of the calculator agent."""
    last = messages[-1]
    if last["role"] == "tool":
        return {"role": "assistant", "content": _text(last["content"]).strip()}
    question = next(_text(m["content"]) for m in reversed(messages) if m["role"] == "user")
    expression = _expression(question)
    # Seeded by the question: the teacher makes the same choice every time it sees a task.
    if random.Random(f"{seed}:{question}").random() >= tool_rate:
        return {"role": "assistant", "content": _value(expression)}
    call = {
        "id": f"call_{uuid.uuid4().hex[:16]}",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def create_app(tool_rate: float, seed: int) -> FastAPI:
    """The teacher's OpenAI-compatible app (chat completions and the model list)."""
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "teacher", "object": "model"}]}

    @app.post("/v1/chat/completions")
    def chat(body: dict) -> dict:
        message = reply(body["messages"], tool_rate, seed)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "teacher"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--tool-rate", type=float, default=0.4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    app = create_app(args.tool_rate, args.seed)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
