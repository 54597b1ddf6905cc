"""Token-by-token streaming: the engine hands out tokens per decode step, the gateway sends
each piece of text before the completion is finished, held back only where the text could
still change (a split character, a possible stop string, a tool-call marker); the span is
still the whole sampled completion, re-scored faithfully."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from tracerl.engines.hf import HFEngine
from tracerl.engines.scoring import score_completion
from tracerl.engines.stub import StubEngine
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.gateway.streaming import TextDeltas
from tracerl.server import serve_in_thread
from tracerl.store.sqlite import SqliteStore
from tracerl.types import Generation, SamplingParams

from .scripted import running_rollout


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _pieces(tokenizer, text: str, stops: list[str], tools: bool, strip: bool) -> list[str]:  # type: ignore[no-untyped-def]
    served = ServedModel("policy", StubEngine(), tokenizer)
    deltas = TextDeltas(served, stops, tools, strip)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [deltas.push([t]) for t in ids]


def test_split_characters_wait_for_their_last_byte(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "héllo → 日本語 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # the byte-level tokenizer splits these characters
    pieces = _pieces(tokenizer, text, [], tools=False, strip=False)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some tokens completed no character


def test_possible_stop_strings_are_held_back(tokenizer) -> None:  # type: ignore[no-untyped-def]
    pieces = _pieces(tokenizer, "12 + 30 = 42 END and more", ["END"], tools=False, strip=False)
    sent = ""
    for piece in pieces:
        sent += piece
        assert "E" not in sent  # never even the start of the stop string
    assert sent == "12 + 30 = 42 "


def test_reply_text_stops_at_a_tool_call_and_is_stripped(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = '  Let me compute. <tool_call>{"name": "calculator", "arguments": {}}</tool_call>'
    pieces = _pieces(tokenizer, text, [], tools=True, strip=True)
    assert "".join(pieces) == "Let me compute."
    assert not any("<" in p for p in pieces)


class GatedEngine(StubEngine):
    """Streams its first token, then waits for the test to have received it: a gateway that
    waited for the whole completion before sending would never get past the gate."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        ids = tokenizer.encode("forty two is 42", add_special_tokens=False)
        super().__init__(ids, tokenizer=tokenizer)
        self.gate = threading.Event()

    async def stream(  # type: ignore[override]
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[list[int] | Generation]:
        gen = await self.generate(prompt_ids, params)
        yield gen.completion_ids[:1]
        if not await asyncio.to_thread(self.gate.wait, 10):
            raise RuntimeError("the first piece never reached the client")
        yield gen.completion_ids[1:]
        yield gen


def _sse(response: httpx.Response) -> Iterator[dict]:
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield orjson.loads(line[len("data: ") :])


@pytest.mark.parametrize("api", ["chat", "responses", "messages", "completions"])
def test_first_piece_is_sent_before_the_completion_ends(tokenizer, api) -> None:  # type: ignore[no-untyped-def]
    engine = GatedEngine(tokenizer)
    gateway = Gateway(None, {"policy": ServedModel("policy", engine, tokenizer)})
    server = serve_in_thread(create_app(gateway))
    messages = [{"role": "user", "content": "What is 40+2?"}]
    path, body = {
        "chat": ("chat/completions", {"messages": messages}),
        "responses": ("responses", {"input": "What is 40+2?"}),
        "messages": ("messages", {"messages": messages, "max_tokens": 64}),
        "completions": ("completions", {"prompt": "What is 40+2?", "max_tokens": 64}),
    }[api]
    text = ""
    try:
        with httpx.stream(
            "POST", f"{server.url}/v1/{path}", json={"model": "policy", "stream": True, **body}
        ) as response:
            for event in _sse(response):
                piece = _piece(api, event)
                if piece and not text:
                    engine.gate.set()  # only now may the engine sample the rest
                text += piece
    finally:
        engine.gate.set()
        server.stop()
    assert text == "forty two is 42"


def _piece(api: str, event: dict) -> str:
    if api == "chat":
        return "".join(c["delta"].get("content") or "" for c in event["choices"])
    if api == "completions":
        return "".join(c["text"] for c in event["choices"])
    if api == "responses":
        return event["delta"] if event["type"] == "response.output_text.delta" else ""
    delta = event.get("delta", {})
    return delta.get("text", "") if event["type"] == "content_block_delta" else ""


def test_hf_stream_is_the_recorded_completion_and_scores_faithfully(
    tiny_model_dir: Path, tokenizer
) -> None:  # type: ignore[no-untyped-def]
    engine = HFEngine(tiny_model_dir, max_batch_size=4)
    store = SqliteStore(":memory:")
    gateway = Gateway(store, {"policy": ServedModel("policy", engine, tokenizer)})
    server = serve_in_thread(create_app(gateway))
    rid = running_rollout(store)
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "What is 37+48?"}],
        "max_tokens": 48,
        "seed": 11,
        "stream": True,
    }
    url = f"{server.url}/rollouts/{rid}/v1/chat/completions"
    try:
        with httpx.stream("POST", url, json=body) as response:
            chunks = list(_sse(response))
        plain = httpx.post(url, json={**body, "stream": False}).json()
        spans = store.spans(rid)
    finally:
        server.stop()
        engine.close()
        store.close()
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content == (plain["choices"][0]["message"]["content"] or "")  # same seed, same text
    assert spans[0].completion_ids == spans[1].completion_ids and len(spans[0].completion_ids) > 1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    span = spans[0]
    rescored = score_completion(model, span.prompt_ids, span.completion_ids, span.temperature)
    assert max(abs(a - b) for a, b in zip(rescored, span.logprobs, strict=True)) <= 1e-4
