"""A model's reasoning (`<think>...</think>`) comes back apart from its content in every API
(chat `reasoning_content`, a Responses `reasoning` item, a Messages `thinking` block),
plain and streamed, while the span keeps every sampled token for training."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from tracerl.engines.stub import StubEngine
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.gateway.toolcalls.reasoning import Reasoning, split_reasoning
from tracerl.models.template import CHAT_TEMPLATE
from tracerl.server import serve_in_thread
from tracerl.store.sqlite import SqliteStore

from .scripted import running_rollout

# The tiny model's template, plus the branch a reasoning model's template has.
THINKING_TEMPLATE = "{#- a reasoning model writes <think>...</think> first -#}" + CHAT_TEMPLATE
REPLY = "<think>\nI add 37 and 48.\n</think>\n\n85"
CALL = '<think>Use the tool.</think><tool_call>{"name": "calculator", "arguments": {"expression": "37+48"}}</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "What is 37+48?"}]


class Served:
    """A gateway whose model answers `text`, with its URL, store and running rollout."""

    def __init__(self, model_dir: Path, text: str, **served: Any) -> None:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer.chat_template = served.pop("template", THINKING_TEMPLATE)
        end = tokenizer.convert_tokens_to_ids("<|end|>")
        self.ids = [*tokenizer.encode(text, add_special_tokens=False), end]
        engine = StubEngine(self.ids, eos_token_ids=[end], tokenizer=tokenizer)
        self.store = SqliteStore(":memory:")
        model = ServedModel("policy", engine, tokenizer, **served)
        self.server = serve_in_thread(create_app(Gateway(self.store, {"policy": model})))
        self.rid = running_rollout(self.store)
        self.base = f"{self.server.url}/rollouts/{self.rid}/v1"

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = httpx.post(f"{self.base}/{path}", json={"model": "policy", **body})
        assert reply.status_code == 200, reply.text
        return reply.json()

    def events(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        body = {"model": "policy", "stream": True, **body}
        with httpx.stream("POST", f"{self.base}/{path}", json=body) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        return [json.loads(line) for line in lines if line != "[DONE]"]

    def close(self) -> None:
        self.server.stop()
        self.store.close()


@pytest.fixture
def thinking(tiny_model_dir: Path) -> Iterator[Served]:
    served = Served(tiny_model_dir, REPLY)
    yield served
    served.close()


def test_chat_reasoning_content_and_the_span_keeps_every_token(thinking: Served) -> None:
    message = thinking.post("chat/completions", {"messages": ASK})["choices"][0]["message"]
    assert message["reasoning_content"] == "I add 37 and 48."
    assert message["content"] == "85"
    (span,) = thinking.store.spans(thinking.rid)
    assert span.completion_ids == thinking.ids  # the reasoning is trained on like the rest
    assert span.response["message"]["reasoning_content"] == "I add 37 and 48."  # type: ignore[index]


def test_chat_stream_sends_reasoning_before_content(thinking: Served) -> None:
    deltas = [
        c["choices"][0]["delta"]
        for c in thinking.events("chat/completions", {"messages": ASK})
        if c["choices"]
    ]
    kinds = [k for d in deltas for k in d if k in ("reasoning_content", "content") and d[k]]
    assert kinds[0] == "reasoning_content" and set(kinds[1:]) == {"content"}
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "I add 37 and 48."
    assert "".join(d.get("content") or "" for d in deltas) == "85"


def test_responses_reasoning_item(thinking: Served) -> None:
    reply = thinking.post("responses", {"input": "What is 37+48?"})
    reasoning, message = reply["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "I add 37 and 48."}]
    assert message["content"][0]["text"] == "85"
    events = thinking.events("responses", {"input": "What is 37+48?"})
    added = [
        (e["output_index"], e["item"]["type"])
        for e in events
        if e["type"] == "response.output_item.added"
    ]
    assert added == [(0, "reasoning"), (1, "message")]
    done = events[-1]["response"]
    assert [item["type"] for item in done["output"]] == ["reasoning", "message"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "85"


def test_messages_thinking_block(thinking: Served) -> None:
    body = {"max_tokens": 64, "messages": ASK}
    reply = thinking.post("messages", body)
    assert reply["content"] == [
        {"type": "thinking", "thinking": "I add 37 and 48.", "signature": ""},
        {"type": "text", "text": "85"},
    ]
    events = thinking.events("messages", body)
    starts = [
        (e["index"], e["content_block"]["type"])
        for e in events
        if e["type"] == "content_block_start"
    ]
    assert starts == [(0, "thinking"), (1, "text")]
    thought = [
        e["delta"]["thinking"] for e in events if e.get("delta", {}).get("type") == "thinking_delta"
    ]
    assert thought == ["I add 37 and 48."]


def test_tool_call_after_reasoning_and_the_next_turn_reuses_ids(tiny_model_dir: Path) -> None:
    served = Served(tiny_model_dir, CALL)
    try:
        first = served.post("chat/completions", {"messages": ASK, "tools": TOOLS})
        message = first["choices"][0]["message"]
        assert message["reasoning_content"] == "Use the tool."
        assert message["tool_calls"][0]["function"]["name"] == "calculator"
        assert not message["content"]
        tool = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "85"}
        served.post("chat/completions", {"messages": [*ASK, message, tool], "tools": TOOLS})
        s0, s1 = served.store.spans(served.rid)
        # The echoed message (reasoning_content and all) is the turn returned: the second
        # prompt starts with the first call's exact ids, its reasoning tokens included.
        assert s1.prefix_break is None
        assert (
            s1.prompt_ids[: len(s0.prompt_ids) + len(s0.completion_ids)]
            == s0.prompt_ids + s0.completion_ids
        )
    finally:
        served.close()


def test_reasoning_opened_by_the_prompt_and_configured_markers(tiny_model_dir: Path) -> None:
    opened = CHAT_TEMPLATE.replace(
        "{{ '<|assistant|>' }}{%- endif -%}", "{{ '<|assistant|><think>' }}{%- endif -%}"
    )
    served = Served(tiny_model_dir, "I add.</think>85", template=opened)
    try:
        message = served.post("chat/completions", {"messages": ASK})["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("I add.", "85")
    finally:
        served.close()
    custom = Served(
        tiny_model_dir,
        "<reason>hm</reason>85",
        template=CHAT_TEMPLATE,
        thinking=("<reason>", "</reason>"),
    )
    try:
        message = custom.post("chat/completions", {"messages": ASK})["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("hm", "85")
    finally:
        custom.close()


def test_models_without_reasoning_keep_their_text(tiny_model_dir: Path) -> None:
    served = Served(tiny_model_dir, REPLY, template=CHAT_TEMPLATE)
    try:
        message = served.post("chat/completions", {"messages": ASK})["choices"][0]["message"]
        assert "reasoning_content" not in message and message["content"].startswith("<think>")
    finally:
        served.close()


def test_split_reasoning() -> None:
    markers = Reasoning()
    assert split_reasoning("<think>a</think>b", markers) == ("a", "b")
    assert split_reasoning("<think>cut off by max_tok", markers) == ("cut off by max_tok", "")
    assert split_reasoning("no thinking here", markers) == ("", "no thinking here")
    assert split_reasoning("x</think>y", Reasoning(open_in_prompt=True)) == ("x", "y")
    assert split_reasoning("<think>a</think>b", None) == ("", "<think>a</think>b")
