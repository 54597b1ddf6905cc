"""A test agent for asset commands: no system message of its own (the gateway's assets
supply the instructions), one short call; and its reward, twice n."""

from __future__ import annotations

import httpx


def run(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    resp = httpx.post(
        f"{base_url}/chat/completions",
        json={
            "model": model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": f"n={task['n']}"}],
        },  # fmt: skip
        headers={"authorization": f"Bearer {api_key}"},
        timeout=60,
    )
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"] or ""


def reward(task: dict, answer: str) -> float:
    return float(answer.strip() == str(2 * task["input"]["n"]))
