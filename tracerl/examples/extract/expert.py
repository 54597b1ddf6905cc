"""A scripted expert writing extraction demonstrations: read the record, answer its JSON."""

from __future__ import annotations

import json
import re

from . import agent, tasks


def conversation(task: dict, index: int) -> list[dict]:
    """The conversation the agent would have with a perfect model."""
    question = task["input"]["question"]
    record = re.search(r"record (R\d+)", question).group(1)  # type: ignore[union-attr]
    call = {"id": f"call_{index}", "type": "function",
            "function": {"name": "read", "arguments": json.dumps({"record": record})}}  # fmt: skip
    return [
        {"role": "system", "content": agent.SYSTEM_PROMPT},
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": agent.read(record)},
        {"role": "assistant", "content": json.dumps(task["answer"])},
    ]


def demonstrations(n: int, seed: int = 1234) -> list[dict]:
    """n demos on train-split tasks drawn with `seed` (never the eval seed 1)."""
    return [{"messages": conversation(t, i), "tools": agent.TOOLS}
            for i, t in enumerate(tasks.make_tasks(n, "train", seed))]  # fmt: skip
