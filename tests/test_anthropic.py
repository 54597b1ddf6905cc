"""The Anthropic Messages API (/v1/messages) driven by the official anthropic client: a
tool-using exchange, token-in/token-out across turns, streaming, count_tokens, what Claude
clients send, and refusals in Anthropic's error shape."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from unittest.mock import ANY

import anthropic
import httpx
import pytest
from transformers import AutoTokenizer

from tracerl.auth import Keys
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.limits import Limits
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store.sqlite import SqliteStore

from .scripted import ScriptedEngine, running_rollout


@pytest.fixture
def served(tiny_model_dir: Path) -> Iterator[tuple[BackgroundServer, SqliteStore, ScriptedEngine]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ScriptedEngine(tokenizer)
    store = SqliteStore(":memory:")
    models = {"policy": ServedModel("policy", engine, tokenizer)}
    gateway = Gateway(store, models, default_model="policy")  # any name -> the policy
    server = serve_in_thread(create_app(gateway))
    yield server, store, engine
    server.stop()
    store.close()


def _client(url: str, rollout_id: str | None = None) -> anthropic.Anthropic:
    base = f"{url}/rollouts/{rollout_id}" if rollout_id else url
    return anthropic.Anthropic(base_url=base, api_key="sk-ant-x", max_retries=0)


TOOLS = [
    {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}},
    }
]
SYSTEM = "Use the calculator, then answer with the number."
QUESTION = {"role": "user", "content": "What is 37+48?"}
MODEL = "claude-sonnet-4-6"  # a name clients hard-code: served by the default model


def _assert_reused(spans) -> None:  # type: ignore[no-untyped-def]
    s0, s1 = spans
    seen = s0.prompt_ids + s0.completion_ids
    assert s1.prompt_ids[: len(seen)] == seen
    assert s1.prefix_reused == len(seen) and s1.prefix_break is None


def _result(tool_use_id: str) -> dict:
    return {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": "85"}],
    }


def test_tool_use_then_answer(served) -> None:  # type: ignore[no-untyped-def]
    server, store, engine = served
    rid = running_rollout(store)
    client = _client(server.url, rid)
    first = client.messages.create(
        model=MODEL, max_tokens=256, system=SYSTEM, messages=[QUESTION], tools=TOOLS
    )
    assert first.stop_reason == "tool_use" and first.id.startswith("msg_")
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "calculator" and use.input == {"expression": "37+48"}
    assert first.usage.input_tokens == len(engine.prompts[0])
    history = [QUESTION, {"role": "assistant", "content": first.content}, _result(use.id)]
    second = client.messages.create(
        model=MODEL, max_tokens=256, system=SYSTEM, messages=history, tools=TOOLS
    )
    assert second.stop_reason == "end_turn"
    assert [(b.type, getattr(b, "text", None)) for b in second.content] == [("text", "85")]
    spans = store.spans(rid)
    assert spans[0].id == first.id.removeprefix("msg_") and spans[0].role == "policy"
    _assert_reused(spans)
    assert engine.prompts[1] == spans[1].prompt_ids


def test_streamed_exchange_reassembles(served) -> None:  # type: ignore[no-untyped-def]
    server, store, _ = served
    rid = running_rollout(store)
    client = _client(server.url, rid)
    with client.messages.stream(
        model=MODEL, max_tokens=256, system=SYSTEM, messages=[QUESTION], tools=TOOLS
    ) as stream:
        kinds = [e.type for e in stream]
        first = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    (use,) = first.content
    assert use.type == "tool_use" and use.input == {"expression": "37+48"}
    assert first.stop_reason == "tool_use"
    history = [QUESTION, {"role": "assistant", "content": first.content}, _result(use.id)]
    with client.messages.stream(
        model=MODEL, max_tokens=256, system=SYSTEM, messages=history, tools=TOOLS
    ) as stream:
        text = "".join(stream.text_stream)
        second = stream.get_final_message()
    assert text == "85" and second.stop_reason == "end_turn"
    _assert_reused(store.spans(rid))


def test_what_claude_clients_send_is_accepted(served) -> None:  # type: ignore[no-untyped-def]
    server, store, _ = served
    rid = running_rollout(store)
    body = {
        "model": "claude-opus-4-1",
        "max_tokens": 10**9,  # far beyond the context: capped to what fits
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is 37+48?"}]},
        ],
        "tools": [*TOOLS, {"type": "web_search_20250305", "name": "web_search"}],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "context_management": {"edits": []},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "u1"},
    }
    headers = {
        "x-api-key": "sk-ant-x",
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "interleaved-thinking-2025-05-14",
    }
    url = f"{server.url}/rollouts/{rid}/v1/messages?beta=true"
    reply = httpx.post(url, json=body, headers=headers)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "claude-opus-4-1"
    (span,) = store.spans(rid)
    assert span.messages[0] == {"role": "system", "content": SYSTEM}
    # An echoed thinking block is dropped; the turn still extends the last one.
    assistant = {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}],
    }
    assistant["content"] += reply.json()["content"]
    use = reply.json()["content"][-1]
    body["messages"] = [*body["messages"], assistant, _result(use["id"])]
    reply = httpx.post(url, json=body, headers=headers)
    assert reply.status_code == 200 and reply.json()["content"][0]["text"] == "85"
    _assert_reused(store.spans(rid))


def test_max_tokens_stop_reason_and_count_tokens(served) -> None:  # type: ignore[no-untyped-def]
    server, _, engine = served
    client = _client(server.url)
    cut = client.messages.create(model=MODEL, max_tokens=2, messages=[QUESTION], tools=TOOLS)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    count = client.messages.count_tokens(model=MODEL, messages=[QUESTION], tools=TOOLS)
    assert count.input_tokens == len(engine.prompts[-1])


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": MODEL, "max_tokens": 5, "messages": []}, 400),
        ({"model": MODEL, "max_tokens": 0, "messages": [QUESTION]}, 400),
        ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400),
        ({"model": MODEL, "messages": [QUESTION], "temperature": "hot"}, 400),
    ],
)
def test_bad_input_is_an_anthropic_error(served, body, status) -> None:  # type: ignore[no-untyped-def]
    server, _, _ = served
    reply = httpx.post(f"{server.url}/v1/messages", json=body)
    assert reply.status_code == status, reply.text
    data = reply.json()
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
    assert data["error"]["message"]


def test_sdk_raises_its_own_errors(served) -> None:  # type: ignore[no-untyped-def]
    server, store, _ = served
    with pytest.raises(anthropic.NotFoundError):
        _client(server.url, "no-such-rollout").messages.create(
            model=MODEL, max_tokens=5, messages=[QUESTION]
        )
    json = {"content-type": "application/json"}
    reply = httpx.post(f"{server.url}/v1/messages", content=b"{nope", headers=json)
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def test_refusals_before_the_route_are_anthropic_errors(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    models = {"policy": ServedModel("policy", ScriptedEngine(tokenizer), tokenizer)}
    gateway = Gateway(SqliteStore(":memory:"), models, default_model="policy")
    keys = Keys(admin="admin-key", runners={"w1": "runner-key"})
    app = create_app(gateway, keys=keys, limits=Limits(max_body_bytes=4_000))
    server = serve_in_thread(app)
    try:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            _client(server.url).messages.create(model=MODEL, max_tokens=5, messages=[QUESTION])
        assert refused.value.body["type"] == "error"  # type: ignore[index]
        body = {"model": MODEL, "max_tokens": 5, "messages": [QUESTION]}
        for path, headers, status, kind in [
            ("/v1/messages", {}, 401, "authentication_error"),
            ("/v1/messages/count_tokens", {"x-api-key": "forged"}, 401, "authentication_error"),
            ("/rollouts/r/v1/messages", {"x-api-key": "runner-key"}, 403, "permission_error"),
        ]:
            reply = httpx.post(f"{server.url}{path}", json=body, headers=headers)
            assert reply.status_code == status, reply.text
            assert reply.json() == {"type": "error", "error": {"type": kind, "message": ANY}}
        big = {**body, "system": "x" * 5_000}
        reply = httpx.post(
            f"{server.url}/v1/messages", json=big, headers={"x-api-key": "admin-key"}
        )
        assert reply.status_code == 413 and reply.json()["error"]["type"] == "request_too_large"
    finally:
        server.stop()
        gateway.close()
