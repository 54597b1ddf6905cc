"""A scripted expert writing text-game demonstrations: each move of the route, then the item."""

from __future__ import annotations

import json

from . import agent, tasks


def conversation(task: dict, index: int) -> list[dict]:
    """The conversation the agent would have with a perfect model."""
    game = agent.Game(task["input"]["world"])
    messages: list[dict] = [{"role": "system", "content": agent.SYSTEM_PROMPT},
                            {"role": "user", "content": task["input"]["question"]}]  # fmt: skip
    for k, direction in enumerate(task["input"]["world"]["route"]):
        call = {"id": f"call_{index}_{k}", "type": "function",
                "function": {"name": "move", "arguments": json.dumps({"direction": direction})}}  # fmt: skip
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": game.move(direction)}]  # fmt: skip
    return [*messages, {"role": "assistant", "content": task["answer"]}]


def demonstrations(n: int, seed: int = 1234) -> list[dict]:
    """n demos on train-split tasks drawn with `seed` (never the eval seed 1)."""
    return [{"messages": conversation(t, i), "tools": agent.TOOLS}
            for i, t in enumerate(tasks.make_tasks(n, "train", seed))]  # fmt: skip
