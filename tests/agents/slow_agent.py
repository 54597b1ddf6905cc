"""A test agent: one model call, a pause (long enough to be killed in), one more call."""

from __future__ import annotations

import os
import time

from openai import OpenAI


def run(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list = [{"role": "user", "content": task["question"]}]
    reply = client.chat.completions.create(model=model, messages=messages)
    time.sleep(float(os.environ.get("SLOW_AGENT_SLEEP", "0")))
    messages += [reply.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": "c", "content": "85"}]
    final = client.chat.completions.create(model=model, messages=messages)
    return final.choices[0].message.content or ""


def crash(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    raise RuntimeError("the agent broke")


def hang(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    time.sleep(5)
    return "late"
