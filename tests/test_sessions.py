"""Calls to plain /v1 that name no rollout: recorded under a session's rollout (one per
session key, token ids reused across its turns), or refused with record="rollouts"; the
store's open_session and what becomes of a session's rollout (idle: succeeded; its gateway
gone: timed_out, never re-queued)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tracerl.examples import example_module
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.gateway.sessions import Sessions, session_key
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store.client import StoreClient
from tracerl.store.http import create_store_app
from tracerl.store.sqlite import SqliteStore
from tracerl.types import RolloutStatus

from .scripted import ScriptedEngine

TOOLS = example_module("calculator", "agent").TOOLS
MESSAGES = [
    {"role": "system", "content": "Use the calculator, then answer with the number."},
    {"role": "user", "content": "What is 37+48?"},
]


def _serve(model_dir: Path, record: str = "all") -> tuple[BackgroundServer, SqliteStore]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    store = SqliteStore(":memory:")
    served = {"policy": ServedModel("policy", ScriptedEngine(tokenizer), tokenizer)}
    gateway = Gateway(store, served, record=record)  # type: ignore[arg-type]
    return serve_in_thread(create_app(gateway)), store


@pytest.fixture
def served(tiny_model_dir: Path) -> Iterator[tuple[BackgroundServer, SqliteStore]]:
    server, store = _serve(tiny_model_dir)
    yield server, store
    server.stop()
    store.close()


def _client(url: str, session: str | None) -> openai.OpenAI:
    headers = {"X-Session-Id": session} if session else None
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, default_headers=headers)


def _two_turns(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="policy", messages=MESSAGES, tools=TOOLS)
    msg = first.choices[0].message
    assert msg.tool_calls
    history = [*MESSAGES, msg.model_dump(exclude_none=True)]
    history.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "85"})
    client.chat.completions.create(model="policy", messages=history, tools=TOOLS)


def test_plain_calls_with_a_session_header_are_one_rollout_with_reused_ids(served) -> None:  # type: ignore[no-untyped-def]
    server, store = served
    _two_turns(_client(server.url, "sess-a"))
    [rollout] = store.rollouts()
    assert rollout.status is RolloutStatus.running and rollout.max_attempts == 1
    assert store.get_task(rollout.task_id).split == "session"
    s0, s1 = store.spans(rollout.id)
    assert s0.completion_ids and s0.logprobs
    # Token-in/token-out across the session's turns: the second prompt extends the first
    # prompt + its sampled ids exactly.
    assert s1.prefix_break is None
    assert s1.prefix_reused == len(s0.prompt_ids) + len(s0.completion_ids)
    assert s1.prompt_ids[: s1.prefix_reused] == s0.prompt_ids + s0.completion_ids


def test_two_sessions_stay_apart(served) -> None:  # type: ignore[no-untyped-def]
    server, store = served
    _two_turns(_client(server.url, "sess-a"))
    _two_turns(_client(server.url, "sess-b"))
    _client(server.url, "sess-a").chat.completions.create(model="policy", messages=MESSAGES)
    rollouts = store.rollouts()
    assert len(rollouts) == 2
    assert sorted(len(store.spans(r.id)) for r in rollouts) == [2, 3]
    assert len({r.task_id for r in rollouts}) == 2


def test_no_session_header_falls_back_to_the_api_key(served) -> None:  # type: ignore[no-untyped-def]
    server, store = served
    for key in ("k1", "k1", "k2"):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
        client.chat.completions.create(model="policy", messages=MESSAGES)
    assert sorted(len(store.spans(r.id)) for r in store.rollouts()) == [1, 2]
    assert all("k1" not in store.get_task(r.task_id).model_dump_json() for r in store.rollouts())


def test_explicit_rollouts_are_not_sessions(served) -> None:  # type: ignore[no-untyped-def]
    server, store = served
    session = _client(server.url, "s")
    session.chat.completions.create(model="policy", messages=MESSAGES)
    [opened] = store.rollouts()
    # Naming the rollout (what a runner's agent does) bypasses sessions altogether.
    headers = {"X-Tracerl-Rollout": opened.id}
    plain = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", default_headers=headers)
    plain.chat.completions.create(model="policy", messages=MESSAGES)
    assert len(store.rollouts()) == 1 and len(store.spans(opened.id)) == 2


def test_record_rollouts_refuses_unattributed_calls_in_each_api(tiny_model_dir: Path) -> None:
    server, store = _serve(tiny_model_dir, record="rollouts")
    try:
        chat = httpx.post(
            f"{server.url}/v1/chat/completions", json={"model": "policy", "messages": MESSAGES}
        )
        assert chat.status_code == 400
        assert chat.json()["error"]["code"] == "rollout_required"
        assert "X-Tracerl-Rollout" in chat.json()["error"]["message"]
        resp = httpx.post(f"{server.url}/v1/responses", json={"model": "policy", "input": "hi"})
        assert resp.status_code == 400 and "X-Tracerl-Rollout" in resp.text
        body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        msg = httpx.post(f"{server.url}/v1/messages", json=body)
        assert msg.status_code == 400
        assert msg.json()["type"] == "error" and "X-Tracerl-Rollout" in msg.text
        assert store.rollouts() == []
    finally:
        server.stop()
        store.close()


def test_session_key_order() -> None:
    both = {"x-tracerl-session": "mine", "x-session-id": "theirs"}
    assert session_key(both, None, "k") == "mine"
    assert session_key({"session_id": "codex"}, None, "k") == "codex"
    assert session_key({}, {"metadata": {"user_id": "u1"}}, "k") == "u1"
    assert session_key({}, {"metadata": {"session_id": "s", "user_id": "u"}}, "k") == "s"
    assert session_key({}, {}, "k").startswith("api-key-sha256:")
    assert session_key({}, {}, "k") != session_key({}, {}, "other")


def test_idle_sessions_finish_succeeded_and_renewals_extend_the_lease() -> None:
    store = SqliteStore(":memory:")
    sessions = Sessions(store, ThreadPoolExecutor(1), idle_s=60, lease_s=120, renew_s=0.0)

    async def scenario() -> tuple[str, str, list[str]]:
        a = await sessions.rollout_id("a")
        before = store.get_rollout(a).lease_expires_at or 0
        await asyncio.sleep(0.01)
        assert await sessions.rollout_id("a") == a
        assert (store.get_rollout(a).lease_expires_at or 0) > before
        b = await sessions.rollout_id("b")
        assert await sessions.sweep() == []  # nothing idle yet
        swept = await sessions.sweep(now=time.monotonic() + 1e6)
        return a, b, swept

    a, b, swept = asyncio.run(scenario())
    assert sorted(swept) == sorted([a, b])
    finished = store.get_rollout(a)
    assert finished.status is RolloutStatus.succeeded and finished.reward is None
    store.close()


def test_renewals_are_spaced_and_a_session_ended_elsewhere_is_reopened() -> None:
    store = SqliteStore(":memory:")
    sessions = Sessions(store, ThreadPoolExecutor(1), idle_s=60, lease_s=120, renew_s=0.2)

    async def scenario() -> tuple[str, float, float, str, str]:
        a = (await sessions.rollout("a")).id
        leased = store.get_rollout(a).lease_expires_at or 0
        await asyncio.sleep(0.01)
        again = await sessions.rollout("a")  # within renew_s: no store call
        unrenewed = store.get_rollout(a).lease_expires_at or 0
        store.finish(a, 1, RolloutStatus.succeeded)  # ended outside this gateway
        await asyncio.sleep(0.25)
        b = await sessions.rollout("a")  # the renewal finds it ended: a new session
        return a, leased, unrenewed, again.id, b.id

    a, leased, unrenewed, again, b = asyncio.run(scenario())
    assert again == a and unrenewed == leased
    assert b != a and store.get_rollout(b).status is RolloutStatus.running
    store.close()


def test_a_dead_gateways_session_times_out_and_is_never_requeued() -> None:
    store = SqliteStore(":memory:")
    r = store.open_session("k", lease_s=5)
    [expired] = store.requeue_expired(now=(r.lease_expires_at or 0) + 1)
    assert expired.status is RolloutStatus.timed_out
    assert store.claim("runner") == []
    store.close()


def test_open_session_over_http() -> None:
    store = SqliteStore(":memory:")
    server = serve_in_thread(create_store_app(store))
    try:
        client = StoreClient(server.url)
        r = client.open_session("remote", lease_s=30)
        assert r.status is RolloutStatus.running and r.attempt == 1 and r.max_attempts == 1
        assert store.get_rollout(r.id).task_id == r.task_id
        assert client.open_session("remote").task_id == r.task_id  # one task per key
    finally:
        server.stop()
        store.close()
