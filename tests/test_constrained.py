"""Enforced outputs in the transformers engine: response_format json_schema / json_object,
tool_choice "required" and a named tool, through the gateway; the recorded log-probs are
those of the grammar-masked distribution, and re-scoring under the span's grammar gives
them back; bad schemas are 4xx errors, engines that cannot constrain are served as usual."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from transformers import AutoTokenizer

from tracerl.engines.hf import HFEngine
from tracerl.engines.scoring import constraint_of, score_completion
from tracerl.engines.stub import StubEngine
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.gateway.chat import ChatRequest
from tracerl.gateway.errors import GatewayError
from tracerl.gateway.toolcalls import parse_reply
from tracerl.server import serve_in_thread
from tracerl.store.sqlite import SqliteStore

from .scripted import running_rollout

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "unit": {"enum": ["m", "kg"]},
    },
    "required": ["answer", "ok", "unit"],
    "additionalProperties": False,
}


def _tool(name: str) -> dict[str, Any]:
    small = {"type": "integer", "minimum": 0, "maximum": 99}
    params = {
        "type": "object",
        "properties": {"a": small, "b": small},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "parameters": params}}


TOOLS = [_tool("add"), _tool("mul")]
MESSAGES = [{"role": "user", "content": "What is 37+48?"}]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path) -> Iterator[tuple[Gateway, SqliteStore, HFEngine]]:
    engine = HFEngine(tiny_model_dir, max_batch_size=64)
    store = SqliteStore(":memory:")
    gateway = Gateway(store, {"policy": ServedModel("policy", engine, engine.tokenizer)})
    yield gateway, store, engine
    gateway.close()
    engine.close()
    store.close()


def _ask(gateway: Gateway, rid: str | None, n: int, **fields: Any) -> list[Any]:
    """n chat calls at once (seeds 0..n-1), under rollout rid."""

    async def all_calls() -> list[Any]:
        reqs = [
            ChatRequest.model_validate(
                {"model": "policy", "messages": MESSAGES, "seed": i, **fields}
            )
            for i in range(n)
        ]
        return list(await asyncio.gather(*(gateway.chat(r, rid) for r in reqs)))

    return asyncio.run(all_calls())


def test_json_schema_gives_valid_objects_and_rescoring_reproduces_logprobs(stack) -> None:  # type: ignore[no-untyped-def]
    gateway, store, engine = stack
    rid = running_rollout(store)
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    served = _ask(gateway, rid, 200, response_format=fmt, max_tokens=48)
    objects = [json.loads(s.choices[0].reply.content) for s in served]
    for obj in objects:
        jsonschema.validate(obj, SCHEMA)
    assert len(objects) == 200
    assert len({json.dumps(o, sort_keys=True) for o in objects}) > 20  # sampled, not fixed
    spans = store.spans(rid)
    assert len(spans) == 200
    for span in spans[:12]:
        constraint = constraint_of(span)
        assert constraint is not None and constraint.eos_token_ids == engine.eos_token_ids
        masked = score_completion(
            engine.model, span.prompt_ids, span.completion_ids, 1.0, constraint, engine.tokenizer
        )
        assert masked == pytest.approx(span.logprobs, abs=1e-4)
        free = score_completion(engine.model, span.prompt_ids, span.completion_ids, 1.0)
        # The mask matters: without it every token is less likely (forced ones by far).
        assert max(m - f for m, f in zip(masked, free, strict=True)) > 0.5
        # A token the grammar forces ('{' first) was drawn with probability 1.
        assert span.logprobs[0] == pytest.approx(0.0, abs=1e-6)


def test_json_object_is_valid_json(stack) -> None:  # type: ignore[no-untyped-def]
    gateway, _, _ = stack
    for s in _ask(gateway, None, 8, response_format={"type": "json_object"}, max_tokens=200):
        c = s.choices[0]
        if c.finish_reason == "stop":  # a random model may fill an object until max_tokens
            assert isinstance(json.loads(c.reply.content), dict)
        else:
            assert c.reply.content.startswith("{")


def test_tool_choice_required_always_calls(stack) -> None:  # type: ignore[no-untyped-def]
    gateway, store, _ = stack
    one = _ask(gateway, None, 50, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    for s in one:
        c = s.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.reply.tool_calls) == 1
        assert c.reply.tool_calls[0]["name"] in {"add", "mul"}
        assert set(c.reply.tool_calls[0]["arguments"]) == {"a", "b"}
    assert len(one) == 50
    many = _ask(gateway, None, 10, tools=TOOLS, tool_choice="required", max_tokens=96)
    assert all(len(s.choices[0].reply.tool_calls) >= 1 for s in many)
    # Without tool_choice the untrained model almost never writes a call.
    free = _ask(gateway, None, 10, tools=TOOLS, max_tokens=32)
    assert sum(bool(s.choices[0].reply.tool_calls) for s in free) <= 1


def test_named_tool_is_the_one_called(stack) -> None:  # type: ignore[no-untyped-def]
    gateway, _, _ = stack
    choice = {"type": "function", "function": {"name": "mul"}}
    for s in _ask(gateway, None, 10, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False):
        assert [c["name"] for c in s.choices[0].reply.tool_calls] == ["mul"]


def test_bad_formats_are_4xx(stack) -> None:  # type: ignore[no-untyped-def]
    gateway, _, _ = stack
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}
    with pytest.raises(GatewayError) as e:
        _ask(gateway, None, 1, response_format=bad)
    assert e.value.status == 400 and "bogus" in e.value.message
    with pytest.raises(ValueError):  # against the API document
        ChatRequest.model_validate(
            {"model": "policy", "messages": MESSAGES, "response_format": {"type": "yaml"}}
        )
    for wrong in (  # rules between fields, checked once the model is known
        {"tool_choice": "required"},  # no tools
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "div"}}},
        {"response_format": {"type": "json_schema"}},  # no schema
        {"tools": TOOLS, "tool_choice": {"type": "function"}},  # no name
    ):
        with pytest.raises(GatewayError) as e:
            _ask(gateway, None, 1, **wrong)
        assert e.value.status == 400 and e.value.param in ("tool_choice", "response_format")
    # Choices of kinds the gateway does not enforce are accepted and force nothing.
    other = {"type": "allowed_tools", "mode": "auto", "tools": []}
    (served,) = _ask(gateway, None, 1, tools=TOOLS, tool_choice=other, max_tokens=4)
    assert served.choices[0].gen.finish_reason in ("stop", "length")


def test_responses_and_messages_enforce_over_http(stack) -> None:  # type: ignore[no-untyped-def]
    gateway, _, _ = stack
    server = serve_in_thread(create_app(gateway, with_store_api=False))
    try:
        text = {"format": {"type": "json_schema", "name": "r", "schema": SCHEMA, "strict": True}}
        body = {"model": "policy", "input": "go", "text": text, "max_output_tokens": 48}
        reply = httpx.post(f"{server.url}/v1/responses", json=body).json()
        (item,) = reply["output"]
        jsonschema.validate(json.loads(item["content"][0]["text"]), SCHEMA)
        assert reply["text"] == text
        tools = [
            {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
            for t in TOOLS
        ]
        msg = {"model": "policy", "max_tokens": 64, "messages": MESSAGES, "tools": tools}
        msg["tool_choice"] = {"type": "tool", "name": "add"}
        reply = httpx.post(f"{server.url}/v1/messages", json=msg).json()
        assert reply["stop_reason"] == "tool_use"
        assert [b["name"] for b in reply["content"] if b["type"] == "tool_use"][0] == "add"
        bad = {**body, "text": {"format": {"type": "json_schema", "schema": {"type": "bogus"}}}}
        refused = httpx.post(f"{server.url}/v1/responses", json=bad)
        assert refused.status_code == 400 and "bogus" in refused.json()["error"]["message"]
    finally:
        server.stop()


def test_engines_that_cannot_constrain_serve_unconstrained(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = SqliteStore(":memory:")
    engine = StubEngine(tokenizer.encode("plain", add_special_tokens=False), tokenizer=tokenizer)
    gateway = Gateway(store, {"policy": ServedModel("policy", engine, tokenizer)})
    try:
        rid = running_rollout(store)
        (served,) = _ask(gateway, rid, 1, tools=TOOLS, tool_choice="required")
        assert served.choices[0].reply.content == "plain"
        (span,) = store.spans(rid)
        assert constraint_of(span) is None  # its log-probs are the free distribution's
    finally:
        gateway.close()
        store.close()


FORCED = {
    "hermes": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
    "<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>",
    "llama3": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
}


@pytest.mark.parametrize("family", sorted(FORCED))
def test_forced_grammar_is_the_models_format(family: str, tiny_model_dir: Path) -> None:
    from tracerl.engines.constrained import ConstrainedParams, Grammars
    from tracerl.gateway.toolcalls import FORMATS
    from tracerl.gateway.toolcalls.enforce import request_grammar

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    grammars = Grammars(tokenizer, [end], len(tokenizer))
    req = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "parallel_tool_calls": False}

    def accepts(text: str, choice: Any) -> bool:
        chat = ChatRequest.model_validate({**req, "tool_choice": choice})
        grammar = request_grammar(chat, TOOLS, FORMATS[family], tokenizer)
        assert grammar is not None
        matcher = grammars.matcher(ConstrainedParams(grammar=grammar))
        assert matcher is not None
        for token in [*tokenizer.encode(text, add_special_tokens=False), end]:
            if not matcher.allowed()[token]:
                return False
            matcher.advance(token)
        return True

    text = FORCED[family]
    assert parse_reply(text, TOOLS, FORMATS[family]).tool_calls  # what the parser reads
    assert accepts(text, "required")
    assert not accepts(text, {"type": "function", "function": {"name": "mul"}})
    assert not accepts(text.replace("1", "100", 1), "required")  # a out of its schema's range
    assert not accepts("sure, " + text, "required")  # nothing but the call
