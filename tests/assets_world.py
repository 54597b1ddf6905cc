"""A small world where an asset's text decides success, for the compare, optimize, CLI and
curriculum tests: a scripted model that answers task n correctly when the system message's
rules allow it, an unchanged agent that asks it, and a mock OpenAI server that plays the
proposer with fixed replies.

Rules the model follows (read off the system message of the prompt it is given):
- no system message: every answer wrong;
- the seed text ("Answer with twice n."): right for even n;
- + "ODD TOO" (helpful): right for every n;
- + "BREAK" (harmful): right only for n divisible by 4;
- + "Worked examples": right for every n (what the bootstrap proposer adds).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from transformers import AutoTokenizer

from tests.scripted import TurnEngine
from tracerl.agents import AgentResult
from tracerl.assets.compare import Arena
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.runner import RunnerConfig
from tracerl.server import serving
from tracerl.store import Store
from tracerl.types import Task

SEED = "Answer with twice n."
HELPFUL = SEED + " Do it for odd n too: ODD TOO."
HARMFUL = SEED + " BREAK the habit of answering."
NEUTRAL = SEED + " Be polite."


def tasks(prefix: str, n: int, split: str = "train") -> list[Task]:
    return [Task(id=f"{prefix}{i}", input={"n": i}, answer=2 * i, split=split) for i in range(n)]


class RuleEngine(TurnEngine):
    """Answers 2n when the system message's rules cover n, else a wrong number."""

    def reply(self, turns: list[tuple[str, str]]) -> str:
        system = next((text for role, text in turns if role == "system"), "")
        user = [text for role, text in turns if role == "user"][-1]
        n = int(user.removeprefix("n="))
        right = SEED in system and (
            n % 2 == 0 or "ODD TOO" in system or "Worked examples" in system
        )
        if "BREAK" in system:
            right = n % 4 == 0
        return str(2 * n if right else 2 * n + 1)


async def agent(task: Task, base_url: str, api_key: str, model: str) -> AgentResult:
    """The unchanged agent: no system message of its own, one call, the reply is the answer."""
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.post(
            f"{base_url}/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": f"n={task.input['n']}"}],
            },
            headers={"authorization": f"Bearer {api_key}"},
        )
    resp.raise_for_status()
    return AgentResult(resp.json()["choices"][0]["message"]["content"])


def reward(task: dict, answer: str) -> float:
    return float(answer.strip() == str(task["answer"]))


@dataclass
class World:
    """A served rule engine over a store, and the arena its arms run in."""

    store: Store
    url: str
    arena: Arena


@contextmanager
def world(tiny_model_dir: Path, store: Store) -> Iterator[World]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = RuleEngine(tokenizer, max_context=512, policy_version=0, logprob=-0.1)
    gateway = Gateway(store, {"policy": ServedModel("policy", engine, tokenizer)})
    with serving(create_app(gateway)) as url:
        arena = Arena(store, url, agent, reward, RunnerConfig(concurrency=8, timeout_s=30))
        yield World(store, url, arena)


@contextmanager
def proposer_server(replies: list[str]) -> Iterator[tuple[str, list[dict]]]:
    """A mock OpenAI server whose call with seed i answers replies[i % len(replies)]; yields
    its /v1 URL and the bodies it received."""
    seen: list[dict] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        seen.append(body)
        text = replies[int(body.get("seed") or 0) % len(replies)]
        message = {"role": "assistant", "content": f"<prompt>\n{text}\n</prompt>"}
        return {"id": "p", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}  # fmt: skip

    with serving(app) as url:
        yield f"{url}/v1", seen
