"""A frozen role served by another OpenAI-compatible server: forwarded, recorded as text.

The remote server here is a second gateway (a real OpenAI-compatible HTTP server); the
front gateway serves "planner" itself and forwards "executor" to it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import Request
from rich.console import Console
from transformers import AutoTokenizer

from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.examples import example_module
from tracerl.gateway import PARENT_HEADER, Gateway, ServedModel, create_app
from tracerl.gateway.remote import RemoteModel
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store.sqlite import SqliteStore
from tracerl.traces import show_rollout

from .scripted import ScriptedEngine, running_rollout

TOOLS = example_module("calculator", "agent").TOOLS
KEY_ENV = "TRACERL_TEST_REMOTE_KEY"
MESSAGES = [
    {"role": "system", "content": "Use the calculator, then answer with the number."},
    {"role": "user", "content": "What is 37+48?"},
]


@dataclass
class Servers:
    front: BackgroundServer
    upstream: BackgroundServer
    store: SqliteStore
    seen: list[tuple[dict, dict]]
    """(headers, body) of each request the upstream server got."""


def _served(tiny_model_dir: Path, name: str) -> ServedModel:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return ServedModel(name, ScriptedEngine(tokenizer), tokenizer)


@pytest.fixture
def servers(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Servers]:
    monkeypatch.setenv(KEY_ENV, "sk-remote")
    seen: list[tuple[dict, dict]] = []
    upstream_app = create_app(Gateway(None, {"policy": _served(tiny_model_dir, "policy")}))

    @upstream_app.middleware("http")
    async def _keep(request: Request, call_next):  # type: ignore[no-untyped-def]
        seen.append((dict(request.headers), json.loads(await request.body() or b"{}")))
        return await call_next(request)

    upstream = serve_in_thread(upstream_app)
    store = SqliteStore(":memory:")
    remote = {
        "executor": RemoteModel("executor", f"{upstream.url}/v1", "policy", KEY_ENV),
        "lost": RemoteModel("lost", "http://127.0.0.1:9/v1", "policy"),
        "unknown": RemoteModel("unknown", f"{upstream.url}/v1", "no-such-model"),
        "keyless": RemoteModel("keyless", f"{upstream.url}/v1", "policy", "TRACERL_NO_SUCH_ENV"),
    }
    gateway = Gateway(store, {"planner": _served(tiny_model_dir, "planner")}, remote=remote)
    front = serve_in_thread(create_app(gateway))
    yield Servers(front, upstream, store, seen)
    front.stop()
    upstream.stop()
    store.close()


def _client(s: Servers, rollout_id: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{s.front.url}/rollouts/{rollout_id}/v1", api_key="x", max_retries=0
    )


def test_remote_role_is_forwarded_and_recorded_as_text_under_its_parent(
    servers: Servers,
) -> None:
    rid = running_rollout(servers.store)
    client = _client(servers, rid)
    plan = client.chat.completions.create(model="planner", messages=MESSAGES, tools=TOOLS)
    parent = {PARENT_HEADER: plan.id}
    first = client.chat.completions.create(
        model="executor", messages=MESSAGES, tools=TOOLS, extra_headers=parent
    )
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert json.loads(call.function.arguments) == {"expression": "37+48"}
    assert first.model == "executor" and first.id.startswith("chatcmpl-")
    history = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True)]
    history.append({"role": "tool", "tool_call_id": call.id, "content": "85"})
    second = client.chat.completions.create(
        model="executor", messages=history, tools=TOOLS, extra_headers=parent
    )
    assert second.choices[0].message.content == "85"
    # The remote server got the agent's request under its own model name, with the key.
    headers, body = servers.seen[-1]
    assert body["model"] == "policy" and body["messages"][-1]["content"] == "85"
    assert "temperature" not in body  # only what the agent sent: the remote's own defaults
    assert headers["authorization"] == "Bearer sk-remote"
    assert PARENT_HEADER.lower() not in headers  # tracerl's own header stays here
    spans = servers.store.spans(rid)
    assert [(s.seq, s.role) for s in spans] == [(0, "planner"), (1, "executor"), (2, "executor")]
    planner, ex1, ex2 = spans
    assert planner.completion_ids and planner.id == plan.id.removeprefix("chatcmpl-")
    for span, reply in ((ex1, first), (ex2, second)):
        assert span.id == reply.id.removeprefix("chatcmpl-")
        assert span.completion_ids == span.prompt_ids == span.logprobs == []
        assert span.policy_version == -1 and span.parent_span_id == planner.id
        recorded = {k: v for k, v in span.response["message"].items() if v is not None}
        assert recorded == reply.choices[0].message.model_dump(exclude_none=True)
    assert ex2.messages[-1]["content"] == "85" and ex1.finish_reason == "tool_calls"
    # Recorded, never trained: the text-only spans make no rows.
    rows = spans_to_transitions(spans, 1.0, group_id="g", task_id="t1")
    assert [r.role for r in rows] == ["planner"]
    console = Console(record=True, width=200)
    show_rollout(servers.store, rid, console)
    text = console.export_text()
    assert text.count("role executor · remote, text only") == 2


def test_remote_role_streams(servers: Servers) -> None:
    rid = running_rollout(servers.store)
    stream = _client(servers, rid).chat.completions.create(
        model="executor", messages=MESSAGES, tools=TOOLS, stream=True
    )
    chunks = list(stream)
    calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
    assert json.loads(calls[0].function.arguments) == {"expression": "37+48"}  # type: ignore[union-attr,arg-type]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert servers.seen[-1][1]["stream"] is False  # the whole reply is recorded, then streamed
    (span,) = servers.store.spans(rid)
    assert span.id == chunks[0].id.removeprefix("chatcmpl-")


@pytest.mark.parametrize(
    ("model", "path", "status", "code"),
    [
        ("lost", "chat/completions", 502, "remote_unreachable"),
        ("unknown", "chat/completions", 404, "remote_error"),
        ("keyless", "chat/completions", 500, "remote_key_missing"),
        ("executor", "completions", 400, "remote_chat_only"),
    ],
)
def test_remote_failures_are_json_errors(
    servers: Servers, model: str, path: str, status: int, code: str
) -> None:
    rid = running_rollout(servers.store)
    body = {"model": model, "messages": MESSAGES, "prompt": "What is"}
    resp = httpx.post(f"{servers.front.url}/rollouts/{rid}/v1/{path}", json=body, timeout=30)
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["code"] == code and model in error["message"]
    assert servers.store.spans(rid) == []  # nothing recorded for a failed call


def test_models_lists_local_and_remote_roles(servers: Servers) -> None:
    listed = httpx.get(f"{servers.front.url}/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["executor", "keyless", "lost", "planner", "unknown"]
