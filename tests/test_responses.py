"""The Responses API (/v1/responses) driven by the official openai client: a tool-using
exchange (items echoed back, or previous_response_id), token-in/token-out across turns,
streaming events, stored responses, what real clients send, and its 4xx errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tracerl.examples import example_module
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store.sqlite import SqliteStore

from .scripted import ScriptedEngine, running_rollout


@pytest.fixture
def served(tiny_model_dir: Path) -> Iterator[tuple[BackgroundServer, SqliteStore, ScriptedEngine]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ScriptedEngine(tokenizer)
    store = SqliteStore(":memory:")
    models = {"policy": ServedModel("policy", engine, tokenizer)}
    gateway = Gateway(store, models, aliases={"gpt-5": "policy"})
    server = serve_in_thread(create_app(gateway))
    yield server, store, engine
    server.stop()
    store.close()


def _client(url: str, rollout_id: str | None = None) -> openai.OpenAI:
    base = f"{url}/rollouts/{rollout_id}/v1" if rollout_id else f"{url}/v1"
    return openai.OpenAI(base_url=base, api_key="x", max_retries=0)


TOOLS = [
    {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
    for t in example_module("calculator", "agent").TOOLS
]
INSTRUCTIONS = "Use the calculator, then answer with the number."
QUESTION = "What is 37+48?"


def _assert_reused(spans) -> None:  # type: ignore[no-untyped-def]
    s0, s1 = spans
    seen = s0.prompt_ids + s0.completion_ids
    assert s1.prompt_ids[: len(seen)] == seen
    assert s1.prefix_reused == len(seen) and s1.prefix_break is None


def test_tool_call_then_answer_with_items_echoed(served) -> None:  # type: ignore[no-untyped-def]
    server, store, engine = served
    rid = running_rollout(store)
    client = _client(server.url, rid)
    first = client.responses.create(
        model="policy", instructions=INSTRUCTIONS, input=QUESTION, tools=TOOLS, store=False
    )
    assert first.status == "completed" and first.id.startswith("resp_")
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "37+48"}
    assert first.usage and first.usage.input_tokens == len(engine.prompts[0])
    items = [{"role": "user", "content": QUESTION}, *[o.model_dump() for o in first.output]]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "85"})
    second = client.responses.create(
        model="policy", instructions=INSTRUCTIONS, input=items, tools=TOOLS, store=False
    )
    assert second.output_text == "85" and second.output[0].type == "message"
    spans = store.spans(rid)
    assert [s.seq for s in spans] == [0, 1] and spans[0].id == first.id.removeprefix("resp_")
    _assert_reused(spans)
    assert engine.prompts[1] == spans[1].prompt_ids
    assert spans[0].messages[0] == {"role": "system", "content": INSTRUCTIONS}


def test_previous_response_id_continues_with_the_same_ids(served) -> None:  # type: ignore[no-untyped-def]
    server, store, _ = served
    rid = running_rollout(store)
    client = _client(server.url, rid)
    first = client.responses.create(
        model="policy", instructions=INSTRUCTIONS, input=QUESTION, tools=TOOLS
    )
    call = first.output[-1]
    assert call.type == "function_call"
    second = client.responses.create(
        model="policy",
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "85"}],
        tools=TOOLS,
    )
    assert second.output_text == "85"
    _assert_reused(store.spans(rid))
    assert client.responses.retrieve(second.id).output_text == "85"


def test_store_false_is_not_retrievable(served) -> None:  # type: ignore[no-untyped-def]
    server, _, _ = served
    client = _client(server.url)
    gone = client.responses.create(model="policy", input=QUESTION, tools=TOOLS, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="policy", previous_response_id=gone.id, input="more")
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_streamed_events_match_the_plain_response(served) -> None:  # type: ignore[no-untyped-def]
    server, store, _ = served
    rid = running_rollout(store)
    client = _client(server.url, rid)
    events = list(
        client.responses.create(
            model="policy", instructions=INSTRUCTIONS, input=QUESTION, tools=TOOLS, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    call = final.output[0]
    assert call.type == "function_call" and json.loads(call.arguments) == {"expression": "37+48"}
    # The second turn, streamed through the SDK's helper, reassembles its text.
    with client.responses.stream(
        model="policy",
        instructions=INSTRUCTIONS,
        previous_response_id=final.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "85"}],
        tools=TOOLS,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        answer = stream.get_final_response()
    assert "".join(deltas) == answer.output_text == "85"
    _assert_reused(store.spans(rid))


def test_what_real_clients_send_is_accepted(served) -> None:  # type: ignore[no-untyped-def]
    server, store, _ = served
    rid = running_rollout(store)
    body = {
        "model": "gpt-5",  # an alias of the served policy
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Be brief."}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
            {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        ],
        "tools": [*TOOLS, {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "k",
        "service_tier": "auto",
        "safety_identifier": "u1",
        "client_metadata": {"x": 1},
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "metadata": {"session": "s1"},
        "max_output_tokens": 10**9,  # far beyond the context: capped to what fits
    }
    reply = httpx.post(f"{server.url}/rollouts/{rid}/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["model"] == "gpt-5" and data["metadata"] == {"session": "s1"}
    assert [t["type"] for t in data["tools"]] == ["function"]
    (span,) = store.spans(rid)
    assert span.role == "policy"
    assert [m["role"] for m in span.messages] == ["system", "user"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "policy", "input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
        (
            {"model": "policy", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content",
        ),
        ({"model": "policy", "input": "hi", "temperature": 3}, "temperature"),
        ({"model": "policy", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "nope", "input": "hi"}, "model"),
        ({"model": "policy"}, "input"),
    ],
)
def test_bad_input_is_a_4xx_in_openai_shape(served, body, param) -> None:  # type: ignore[no-untyped-def]
    server, _, _ = served
    reply = httpx.post(f"{server.url}/v1/responses", json=body)
    assert 400 <= reply.status_code < 500, reply.text
    assert reply.json()["error"]["param"] == param


def test_invalid_json_is_a_400(served) -> None:  # type: ignore[no-untyped-def]
    server, _, _ = served
    json = {"content-type": "application/json"}
    reply = httpx.post(f"{server.url}/v1/responses", content=b"{nope", headers=json)
    assert reply.status_code == 400 and "JSON" in reply.json()["error"]["message"]


def test_aliases_are_configured_and_checked(tiny_model_dir: Path) -> None:
    from tracerl.entrypoints.config import ServeCommand

    cfg = ServeCommand.model_validate(
        {"model": "m", "gateway": {"model_aliases": {"gpt-5": "policy"}, "default_model": "policy"}}
    )
    assert cfg.gateway.model_aliases == {"gpt-5": "policy"}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    models = {"policy": ServedModel("policy", ScriptedEngine(tokenizer), tokenizer)}
    names = cfg.gateway
    gateway = Gateway(None, models, aliases=names.model_aliases, default_model=names.default_model)
    assert [gateway.role(n) for n in ("policy", "gpt-5", "claude-x")] == ["policy"] * 3
    with pytest.raises(ValueError, match="nobody serves"):
        Gateway(None, models, aliases={"gpt-5": "planner"})
