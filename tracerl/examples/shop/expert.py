"""A scripted expert writing shopping demonstrations: price, then calculator, then total."""

from __future__ import annotations

import json
import re

from . import agent, tasks


def _call(call_id: str, name: str, args: dict) -> dict:
    function = {"name": name, "arguments": json.dumps(args)}
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}]}  # fmt: skip


def conversation(task: dict, index: int) -> list[dict]:
    """The conversation the agent would have with a perfect model."""
    question = task["input"]["question"]
    qty, item = re.search(r"do (\d+) (\w+)s cost", question).groups()  # type: ignore[union-attr]
    listed = agent.price(item)
    expression = f"{qty}*{listed.split(': ')[1].split()[0]}"
    total = agent.calculator(expression)
    return [
        {"role": "system", "content": agent.SYSTEM_PROMPT},
        {"role": "user", "content": question},
        _call(f"call_{index}_0", "price", {"item": item}),
        {"role": "tool", "tool_call_id": f"call_{index}_0", "content": listed},
        _call(f"call_{index}_1", "calculator", {"expression": expression}),
        {"role": "tool", "tool_call_id": f"call_{index}_1", "content": total},
        {"role": "assistant", "content": total},
    ]


def demonstrations(n: int, seed: int = 1234) -> list[dict]:
    """n demos on train-split tasks drawn with `seed` (never the eval seed 1)."""
    return [{"messages": conversation(t, i), "tools": agent.TOOLS}
            for i, t in enumerate(tasks.make_tasks(n, "train", seed))]  # fmt: skip
