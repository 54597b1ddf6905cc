"""A text-game agent written against the public OpenAI client only: the model walks a
route one `move` at a time (a state machine: each move is checked against the next step of
the route) and answers with what it finds in the last room."""

from __future__ import annotations

import functools
import json

import httpx
from openai import OpenAI

SYSTEM_PROMPT = "Move step by step, then name what you find."
TOOLS = [{"type": "function", "function": {
    "name": "move", "description": "Walk one room in a direction.",
    "parameters": {"type": "object", "properties": {"direction": {"type": "string"}},
                   "required": ["direction"]}}}]  # fmt: skip
MAX_TURNS = 6


class Game:
    """The world of one task: where the player is along the route."""

    def __init__(self, world: dict) -> None:
        self.world, self.at = world, 0

    def move(self, direction: str) -> str:
        """The next room when `direction` is the route's next step, else a wall."""
        route, rooms = self.world["route"], self.world["rooms"]
        if self.at >= len(route) or direction.strip().lower() != route[self.at]:
            return "A wall blocks the way."
        self.at += 1
        if self.at == len(route):
            return f"You enter the {rooms[self.at - 1]}. A {self.world['item']} lies here."
        return f"You enter the {rooms[self.at - 1]}."


@functools.cache
def _http() -> httpx.Client:
    return httpx.Client(timeout=60.0, limits=httpx.Limits(max_connections=256))


def run(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    """Play one task ({"question", "world"}); returns the final answer text."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=_http())
    game = Game(task["world"])
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
                direction = str(json.loads(call.function.arguments).get("direction", ""))
            except (json.JSONDecodeError, AttributeError):
                direction = ""
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": game.move(direction)}
            )
    return ""
