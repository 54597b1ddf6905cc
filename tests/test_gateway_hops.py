"""Where the gateway does a call's small jobs: a short chat's prompt is built on the event
loop (cheaper than the hop to the tokenizer thread) only while that thread is idle, and
gives the same ids as one built on the thread; a long chat always goes to the thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tracerl.examples import example_module
from tracerl.gateway import Gateway, ServedModel, prompting
from tracerl.gateway.chat import ChatRequest
from tracerl.gateway.prompting import INLINE_CHARS, inline_chat
from tracerl.store.sqlite import SqliteStore
from tracerl.types import Task

from .scripted import ScriptedEngine

TOOLS = example_module("calculator", "agent").TOOLS
MESSAGES = [
    {"role": "system", "content": "Use the calculator, then answer with the number."},
    {"role": "user", "content": "What is 37+48?"},
]


@pytest.fixture
def gateway(tiny_model_dir: Path) -> Iterator[Gateway]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = SqliteStore(":memory:")
    store.add_tasks([Task(id="t1", input={"question": "What is 37+48?"})])
    gateway = Gateway(
        store, {"policy": ServedModel("policy", ScriptedEngine(tokenizer), tokenizer)}
    )
    yield gateway
    gateway.close()
    store.close()


def _where_built(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads each prompt of the gateway's model is built on, from now."""
    prompts = gateway.models["policy"].prompts
    build, where = prompts.build, []

    def spy(*args: Any) -> Any:
        where.append(threading.current_thread().name)
        return build(*args)

    monkeypatch.setattr(prompts, "build", spy)
    return where


def _prompt_ids(gateway: Gateway, messages: list[dict], busy_s: float = 0.0) -> list[int]:
    """The prompt ids of a chat call under a fresh running rollout; with `busy_s`, sent
    while the tokenizer thread is busy with another job for that long."""
    assert gateway.store is not None
    gateway.store.enqueue(["t1"])
    rollout = gateway.store.claim("runner", 1, 60.0)[0]
    req = ChatRequest.model_validate({"model": "policy", "messages": messages, "tools": TOOLS})

    async def call() -> list[int]:
        other = asyncio.ensure_future(gateway._tokenize(time.sleep, busy_s))
        await asyncio.sleep(0)  # the other job is on the thread first
        pending = await gateway.open_chat(req, rollout.id)
        await other
        return pending.prompt.ids

    return asyncio.run(call())


def test_a_short_chat_built_inline_has_the_ids_of_one_built_on_the_thread(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    where = _where_built(gateway, monkeypatch)
    assert inline_chat(ChatRequest.model_validate({"model": "policy", "messages": MESSAGES}))
    inline = _prompt_ids(gateway, MESSAGES)
    monkeypatch.setattr(prompting, "INLINE_CHARS", 0)  # every chat to the tokenizer thread
    threaded = _prompt_ids(gateway, MESSAGES)
    assert inline == threaded and inline
    assert where == [threading.main_thread().name, "tracerl-tokenize_0"]


def test_the_loop_leaves_a_busy_tokenizer_to_its_thread(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    where = _where_built(gateway, monkeypatch)
    _prompt_ids(gateway, MESSAGES, busy_s=0.2)  # short, but the thread is in use: queued
    assert where == ["tracerl-tokenize_0"]


def test_a_long_chat_goes_to_the_tokenizer_thread(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    where = _where_built(gateway, monkeypatch)
    long = [MESSAGES[0], {"role": "user", "content": "What is 37+48? " * INLINE_CHARS}]
    assert not inline_chat(ChatRequest.model_validate({"model": "policy", "messages": long}))
    deep: Any = "x"
    for _ in range(10_000):  # nesting is the client's to choose: judged without recursion
        deep = [deep]
    nested = [{"role": "user", "content": "hi", "extra": deep}]
    assert not inline_chat(ChatRequest.model_validate({"model": "policy", "messages": nested}))
    with pytest.raises(Exception, match="context length"):
        _prompt_ids(gateway, long)
    assert where == ["tracerl-tokenize_0"]
