"""A scripted expert writing lookup demonstrations: search the town, answer the number."""

from __future__ import annotations

import json
import re

from . import agent, tasks


def conversation(task: dict, index: int) -> list[dict]:
    """The conversation the agent would have with a perfect model."""
    question = task["input"]["question"]
    town = re.search(r"of (\w+)\?", question).group(1)  # type: ignore[union-attr]
    field = re.search(r"the (\w+) of", question).group(1)  # type: ignore[union-attr]
    result = agent.search(town)
    value = re.search(rf"{field} (\d+)", result).group(1)  # type: ignore[union-attr]
    call = {"id": f"call_{index}", "type": "function",
            "function": {"name": "search", "arguments": json.dumps({"town": town})}}  # fmt: skip
    return [
        {"role": "system", "content": agent.SYSTEM_PROMPT},
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": result},
        {"role": "assistant", "content": value},
    ]


def demonstrations(n: int, seed: int = 1234) -> list[dict]:
    """n demos on train-split tasks drawn with `seed` (never the eval seed 1)."""
    return [{"messages": conversation(t, i), "tools": agent.TOOLS}
            for i, t in enumerate(tasks.make_tasks(n, "train", seed))]  # fmt: skip
