"""The transfer benchmark's task families: each expert's conversation, replayed as the
model's turns through the family's own agent, earns reward 1; its degraded copy (tools
skipped, a corrupted guess) earns 0; every demonstration fits the tiny model's context."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessage

from tracerl.examples import example_module
from tracerl.models.recipe import degrade
from tracerl.models.sft import Demo

FAMILIES = ("lookup", "textgame", "extract", "shop")


class _Replay:
    """Stands in for OpenAI(...): answers each call with the next scripted assistant turn,
    and records the tool results the agent sent back."""

    def __init__(self, turns: list[dict]) -> None:
        self.turns, self.seen = list(turns), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def __call__(self, **_: Any) -> _Replay:
        return self

    def create(self, *, messages: list, **_: Any) -> SimpleNamespace:
        self.seen = [m for m in messages if m.get("role") == "tool"]
        message = ChatCompletionMessage.model_validate(self.turns.pop(0))
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def _play(
    family: str, task: dict, messages: list[dict], monkeypatch: pytest.MonkeyPatch
) -> tuple[str, _Replay]:
    agent = example_module(family, "agent")
    replay = _Replay([m for m in messages if m["role"] == "assistant"])
    monkeypatch.setattr(agent, "OpenAI", replay)
    answer = agent.run(task["input"], base_url="http://unused", api_key="x", model="policy")
    return answer, replay


@pytest.mark.parametrize("family", FAMILIES)
def test_the_expert_solves_held_out_tasks_through_the_agent(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tasks, expert = example_module(family, "tasks"), example_module(family, "expert")
    reward = example_module(family, "reward").reward
    for i, task in enumerate(tasks.make_tasks(20, "eval", 1)):
        messages = expert.conversation(task, i)
        answer, replay = _play(family, task, messages, monkeypatch)
        assert reward(task, answer) == 1.0, (task, answer)
        # The agent's tools answered what the expert's demonstration says they answer.
        told = [m["content"] for m in messages if m["role"] == "tool"]
        assert [m["content"] for m in replay.seen] == told


@pytest.mark.parametrize("family", FAMILIES)
def test_a_degraded_demonstration_fails_and_demos_fit_the_context(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tracerl.models.template import render_chat

    tasks, expert = example_module(family, "tasks"), example_module(family, "expert")
    reward = example_module(family, "reward").reward
    rng = random.Random(0)
    demos = expert.demonstrations(30, seed=5)
    for task, demo in zip(tasks.make_tasks(30, "train", 5), demos, strict=True):
        bad = degrade(Demo.model_validate(demo), rng)
        answer, _ = _play(family, task, [dict(m) for m in bad.messages], monkeypatch)
        assert reward(task, answer) == 0.0, (task, answer)
        # ~4 characters a token at worst for the tiny byte-level BPE; 512 positions.
        assert len(render_chat(demo["messages"], demo["tools"])) < 4 * 512
    assert len({d["messages"][1]["content"] for d in demos}) > 10  # varied tasks
