"""The gateway driven by the official openai client: tool calls, streaming, multi-turn,
n > 1, stop sequences, token-in/token-out, and every bad-input case with its 4xx error."""

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
from tracerl.gateway.prompting import INLINE_IDS
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store.sqlite import SqliteStore
from tracerl.types import Task

from .scripted import ScriptedEngine, running_rollout


@pytest.fixture
def served(tiny_model_dir: Path) -> Iterator[tuple[BackgroundServer, SqliteStore, ScriptedEngine]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ScriptedEngine(tokenizer)
    store = SqliteStore(":memory:")
    gateway = Gateway(store, {"policy": ServedModel("policy", engine, tokenizer)})
    server = serve_in_thread(create_app(gateway))
    yield server, store, engine
    server.stop()
    store.close()


def _client(url: str, rollout_id: str | None = None) -> openai.OpenAI:
    base = f"{url}/rollouts/{rollout_id}/v1" if rollout_id else f"{url}/v1"
    return openai.OpenAI(base_url=base, api_key="x", max_retries=0)


TOOLS = example_module("calculator", "agent").TOOLS
MESSAGES = [
    {"role": "system", "content": "Use the calculator, then answer with the number."},
    {"role": "user", "content": "What is 37+48?"},
]


def test_tool_call_then_answer_reuses_exact_ids(served) -> None:  # type: ignore[no-untyped-def]
    server, store, engine = served
    rid = running_rollout(store)
    client = _client(server.url, rid)
    first = client.chat.completions.create(model="policy", messages=MESSAGES, tools=TOOLS)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls and msg.tool_calls[0].function.name == "calculator"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"expression": "37+48"}
    assert first.usage and first.usage.prompt_tokens == len(engine.prompts[0])
    history = [*MESSAGES, msg.model_dump(exclude_none=True)]
    history.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "85"})
    second = client.chat.completions.create(model="policy", messages=history, tools=TOOLS)
    assert second.choices[0].message.content == "85"
    assert second.choices[0].finish_reason == "stop"
    spans = store.spans(rid)
    assert [s.seq for s in spans] == [0, 1]
    s0, s1 = spans
    assert s1.prompt_ids[: len(s0.prompt_ids) + len(s0.completion_ids)] == (
        s0.prompt_ids + s0.completion_ids
    )
    assert s1.prefix_reused == len(s0.prompt_ids) + len(s0.completion_ids)
    assert s1.prefix_break is None
    assert s0.policy_version == 3 and s0.role == "policy"
    assert s0.logprobs == pytest.approx([-0.1] * len(s0.completion_ids))
    # Without token-in/token-out the re-rendered prompt would differ from what was sampled
    # whenever the template spells the call differently; here it must agree token for token.
    assert engine.prompts[1] == s1.prompt_ids


def test_an_edited_history_is_a_thread_and_a_changed_reply_a_prefix_break(served) -> None:  # type: ignore[no-untyped-def]
    server, store, _ = served
    rid = running_rollout(store)
    client = _client(server.url, rid)
    client.chat.completions.create(model="policy", messages=MESSAGES, tools=TOOLS)
    edited = [
        MESSAGES[0],
        {"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "and 37+48?"},
    ]
    client.chat.completions.create(model="policy", messages=edited, tools=TOOLS)
    # Another conversation: a thread of its own, branched from the first (threads.py).
    s0, s1 = store.spans(rid)
    assert (s1.prefix_break, s1.prefix_reused) == (None, 0)
    assert s1.thread_id == s1.id != s0.thread_id and s1.parent_thread_id == s0.thread_id
    # The first conversation carried on with our reply rewritten: its ids cannot be reused.
    changed = [*MESSAGES, {"role": "assistant", "content": "let me think"}]
    changed.append({"role": "user", "content": "go on"})
    client.chat.completions.create(model="policy", messages=changed, tools=TOOLS)
    s2 = store.spans(rid)[2]
    assert (s2.prefix_break, s2.prefix_reused, s2.thread_id) == (
        "assistant message changed",
        0,
        s0.thread_id,
    )


def test_streaming_reassembles_to_the_same_message(served) -> None:  # type: ignore[no-untyped-def]
    server, store, _ = served
    rid = running_rollout(store)
    client = _client(server.url, rid)
    plain = client.chat.completions.create(model="policy", messages=MESSAGES, tools=TOOLS)
    stream = client.chat.completions.create(
        model="policy",
        messages=MESSAGES,
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, calls, finish, usage = "", {}, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    want = plain.choices[0].message.tool_calls
    assert want and [(c["name"], c["arguments"]) for c in calls.values()] == [
        (t.function.name, t.function.arguments) for t in want
    ]
    assert content == (plain.choices[0].message.content or "")
    assert finish == "tool_calls" and usage is not None and usage.completion_tokens > 0
    assert len(store.spans(rid)) == 2  # the streamed call was recorded too


def test_streamed_text_reassembles(served) -> None:  # type: ignore[no-untyped-def]
    server, _, _ = served
    client = _client(server.url)
    history = [*MESSAGES, {"role": "assistant", "content": ""}, {"role": "tool", "content": "85"}]
    plain = client.chat.completions.create(model="policy", messages=history)
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="policy", messages=history, stream=True)
        if c.choices
    ]
    assert "".join(pieces) == plain.choices[0].message.content == "85"


def _chunks(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json=body) as resp:
        assert resp.status_code == 200
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "policy", "messages": MESSAGES, "tools": TOOLS}),
        ("/v1/chat/completions", {"model": "policy", "messages": MESSAGES, "n": 2}),
        ("/v1/completions", {"model": "policy", "prompt": "What is 37+48?"}),
    ],
)
def test_with_include_usage_every_chunk_but_the_last_has_usage_null(served, path, body) -> None:  # type: ignore[no-untyped-def]
    server, _, _ = served
    streamed = {**body, "stream": True}
    chunks = _chunks(server.url, path, {**streamed, "stream_options": {"include_usage": True}})
    assert len(chunks) > 2
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    assert all("usage" not in c for c in _chunks(server.url, path, streamed))


def test_n_choices_each_recorded(served) -> None:  # type: ignore[no-untyped-def]
    server, store, _ = served
    rid = running_rollout(store)
    reply = _client(server.url, rid).chat.completions.create(
        model="policy", messages=MESSAGES, tools=TOOLS, n=3, seed=5
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len(store.spans(rid)) == 3


def test_header_attribution_and_logprobs(served) -> None:  # type: ignore[no-untyped-def]
    server, store, _ = served
    rid = running_rollout(store)
    client = openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key="x",
        max_retries=0,
        default_headers={"X-Tracerl-Rollout": rid},
    )
    reply = client.chat.completions.create(model="policy", messages=MESSAGES, logprobs=True)
    lp = reply.choices[0].logprobs
    assert lp and lp.content and all(t.logprob == pytest.approx(-0.1) for t in lp.content)
    assert len(store.spans(rid)) == 1


def test_max_tokens_truncates(served) -> None:  # type: ignore[no-untyped-def]
    server, _, _ = served
    reply = _client(server.url).chat.completions.create(
        model="policy", messages=MESSAGES, tools=TOOLS, max_tokens=3
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage and reply.usage.completion_tokens == 3


def test_models_and_completions(served) -> None:  # type: ignore[no-untyped-def]
    server, _, _ = served
    client = _client(server.url)
    assert [m.id for m in client.models.list()] == ["policy"]
    reply = client.completions.create(model="policy", prompt="<|user|>hi<|end|>", max_tokens=40)
    assert reply.choices[0].text


def test_token_id_prompts_are_checked_inline_and_on_the_tokenizer_thread(served) -> None:  # type: ignore[no-untyped-def]
    server, store, engine = served
    rollout_id = running_rollout(store)
    url = f"{server.url}/rollouts/{rollout_id}/v1/completions"
    ids = engine.tokenizer("<|user|>hi<|end|>")["input_ids"]
    ok = httpx.post(url, json={"model": "policy", "prompt": ids, "max_tokens": 4})
    assert ok.status_code == 200, ok.text
    assert engine.prompts[-1] == ids and store.spans(rollout_id)[-1].prompt_ids == ids
    vocab = len(engine.tokenizer)
    short = [*ids, vocab]  # checked on the event loop
    long = [*ids * (INLINE_IDS // len(ids) + 1), -1]  # past INLINE_IDS: the tokenizer thread
    for prompt in (short, long, []):
        bad = httpx.post(url, json={"model": "policy", "prompt": prompt, "max_tokens": 4})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "prompt"
    assert len(store.spans(rollout_id)) == 1


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "nope", "messages": MESSAGES}, 404, "model_not_found"),
        ({"model": "policy", "messages": []}, 400, None),
        ({"model": "policy", "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        ({"model": "policy", "messages": MESSAGES, "temperature": 5}, 400, None),
        ({"model": "policy", "messages": MESSAGES, "top_p": 0}, 400, None),
        ({"model": "policy", "messages": MESSAGES, "n": 0}, 400, None),
        ({"model": "policy", "messages": MESSAGES, "max_tokens": 0}, 400, None),
        # Past 64 bits a torch generator refuses the seed: that was a 500 from the engine.
        ({"model": "policy", "messages": MESSAGES, "seed": 2**64}, 400, None),
        ({"model": "policy", "messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, 400, None),
        ({"model": "policy", "messages": MESSAGES, "tools": [{"type": "web"}]}, 400, None),
        (
            {
                "model": "policy",
                "messages": MESSAGES,
                "tools": [{"type": "function", "function": {"name": "bad name!"}}],
            },
            400,
            None,
        ),
        (
            {
                "model": "policy",
                "messages": MESSAGES,
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ],
            },
            400,
            None,
        ),
        (
            {"model": "policy", "messages": [{"role": "user", "content": "x" * 4000}]},
            400,
            "context_length_exceeded",
        ),
    ],
)
def test_bad_requests_get_openai_errors(served, body, status, code) -> None:  # type: ignore[no-untyped-def]
    server, _, _ = served
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"]
    if code:
        assert err["code"] == code


def test_malformed_json_and_rollout_errors(served) -> None:  # type: ignore[no-untyped-def]
    server, store, _ = served
    resp = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        _client(server.url, "no-such-rollout").chat.completions.create(
            model="policy", messages=MESSAGES
        )
    rid = running_rollout(store)
    rollout = store.get_rollout(rid)
    from tracerl.types import RolloutStatus

    store.finish(rid, rollout.attempt, RolloutStatus.succeeded, "85", 1.0)
    with pytest.raises(openai.ConflictError):
        _client(server.url, rid).chat.completions.create(model="policy", messages=MESSAGES)
    resp = httpx.post(f"{server.url}/rollouts/{rid}/reward", json={"value": "high"})
    assert resp.status_code == 400


def test_reward_over_http(served) -> None:  # type: ignore[no-untyped-def]
    server, store, _ = served
    rid = running_rollout(store)
    resp = httpx.post(f"{server.url}/rollouts/{rid}/reward", json={"value": 0.5})
    assert resp.status_code == 200
    resp = httpx.post(f"{server.url}/rollouts/{rid}/reward", json={"value": 1, "role": "executor"})
    assert resp.status_code == 200
    assert [(r.value, r.role) for r in store.rewards(rid)] == [(0.5, None), (1.0, "executor")]
    both = {"value": 1, "role": "executor", "span_seq": 0}
    resp = httpx.post(f"{server.url}/rollouts/{rid}/reward", json=both)
    assert resp.status_code == 400 and "not both" in resp.json()["error"]["message"]


@pytest.mark.parametrize("content", [b'{"value": 1e308}', b'{"value": -1e7}'])
def test_absurd_rewards_are_refused(served, content: bytes) -> None:  # type: ignore[no-untyped-def]
    """Regression: {"value": 1e308} was stored, and GRPO over it raised OverflowError."""
    server, store, _ = served
    rid = running_rollout(store)
    json = {"content-type": "application/json"}
    resp = httpx.post(f"{server.url}/rollouts/{rid}/reward", content=content, headers=json)
    assert resp.status_code == 400 and "value" in resp.json()["error"]["message"]
    assert store.rewards(rid) == []
    assert httpx.post(f"{server.url}/rollouts/{rid}/reward", json={"value": 1e6}).status_code == 200


def test_two_gateways_serving_one_attempt_number_its_calls_in_turn(tiny_model_dir: Path) -> None:
    """Regression: each gateway process kept the next span number itself, so a call served
    by one gateway after the other had served one reused its seq: a 500 after sampling."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = SqliteStore(":memory:")
    servers = [
        serve_in_thread(create_app(Gateway(
            store, {"policy": ServedModel("policy", ScriptedEngine(tokenizer), tokenizer)}
        )))
        for _ in range(2)
    ]  # fmt: skip
    try:
        rid = running_rollout(store)
        for server in (servers[0], servers[1], servers[0]):
            _client(server.url, rid).chat.completions.create(model="policy", messages=MESSAGES)
        assert [s.seq for s in store.spans(rid)] == [0, 1, 2]
    finally:
        for server in servers:
            server.stop()
        store.close()


def test_bounded_memory_recovers_call_numbers_from_the_store(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = SqliteStore(":memory:")
    gateway = Gateway(
        store, {"policy": ServedModel("policy", ScriptedEngine(tokenizer), tokenizer)}, memory=1
    )
    server = serve_in_thread(create_app(gateway))
    try:
        first, second = running_rollout(store), None
        store.add_tasks([Task(id="t2", input={"question": "?"})])
        store.enqueue(["t2"])
        second = store.claim("r", 1, 60.0)[0].id
        for rid in (first, second, first, second):  # each call evicts the other rollout
            _client(server.url, rid).chat.completions.create(model="policy", messages=MESSAGES)
        assert [s.seq for s in store.spans(first)] == [0, 1]
        assert [s.seq for s in store.spans(second)] == [0, 1]
    finally:
        server.stop()
        store.close()


def test_finished_rollouts_leave_nothing_remembered(tiny_model_dir: Path) -> None:
    """A long-running gateway's memory follows the rollouts in flight, not those served."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = SqliteStore(":memory:")
    gateway = Gateway(
        store, {"policy": ServedModel("policy", ScriptedEngine(tokenizer), tokenizer)}
    )
    server = serve_in_thread(create_app(gateway))
    try:
        store.add_tasks([Task(id="t", input={"question": "?"})])
        store.enqueue(["t"] * 5)
        for rollout in store.claim("r", 5, 60.0):
            client = _client(server.url, rollout.id)
            for _ in range(2):
                client.chat.completions.create(model="policy", messages=MESSAGES, tools=TOOLS)
            assert len(gateway.histories) and gateway.recorder._calls
            body = {"attempt": rollout.attempt, "status": "succeeded", "reward": 1.0}
            url = f"{server.url}/store/rollouts/{rollout.id}/finish"
            assert httpx.post(url, json=body).status_code == 200
        assert len(store.spans(rollout.id)) == 2
        assert not len(gateway.histories) and not gateway.recorder._calls
    finally:
        server.stop()
        store.close()


def test_histories_keep_the_most_recently_used_attempts() -> None:
    from tracerl.gateway.histories import Histories
    from tracerl.gateway.served import Choice
    from tracerl.gateway.threads import Placement
    from tracerl.gateway.tito import Prompt
    from tracerl.gateway.toolcalls import ParsedReply
    from tracerl.types import Generation

    gen = Generation(
        completion_ids=[7, 8], logprobs=[0.0, 0.0], finish_reason="stop", policy_version=0
    )
    choice = Choice(0, gen, "hi", ParsedReply(content="hi", tool_calls=[]), [], "stop")
    histories = Histories(memory=2, threads=2)
    asked = [{"role": "user", "content": "?"}]
    for rollout in ("a", "b", "a", "c"):  # a's second call makes b the least recently used
        thread = Placement(f"{rollout}-thread", None, None)
        key = (rollout, 0, "policy", None)
        histories.remember(key, thread, asked, None, Prompt([1, 2]), [choice], [f"{rollout}-s"])
    assert histories.threads("b", 0) == []
    assert [t.id for t in histories.threads("a", 0)] == ["a-thread"]
    (kept,) = histories.threads("c", 0)
    assert kept.history.turns[0].ids == [1, 2, 7, 8] and kept.history.turns[0].end == "eos"
    assert histories.thread_of("c", 0, "c-s") == "c-thread" and not kept.pending
    # Within an attempt, the least recently used threads beyond the bound go.
    for name in ("t1", "t2", "t3"):
        thread = Placement(name, None, None)
        histories.remember(("c", 0, "policy", None), thread, asked, None, Prompt([1]), [choice], [])
    assert [t.id for t in histories.threads("c", 0)] == ["t3", "t2"]
    histories.forget("c", 0)
    assert len(histories) == 1 and histories.threads("c", 0) == []


def test_stop_sequences_with_a_real_engine(tiny_model_dir: Path) -> None:
    from tracerl.engines.hf import HFEngine

    engine = HFEngine(tiny_model_dir, max_batch_size=4)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = SqliteStore(":memory:")
    gateway = Gateway(store, {"policy": ServedModel("policy", engine, tokenizer)})
    server = serve_in_thread(create_app(gateway))
    try:
        client = _client(server.url)
        # A random tiny model babbles; a seeded request repeats its babble exactly. Find a
        # seed whose babble is long enough to cut in the middle.
        for seed in range(50):
            ask = {"model": "policy", "messages": MESSAGES, "max_tokens": 24, "seed": seed}
            full = client.chat.completions.create(**ask).choices[0].message.content or ""
            if len(full) > 8 and full == full.strip():
                break
        assert len(full) > 8
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        cut = client.chat.completions.create(**ask, stop=[stop]).choices[0]
        assert cut.finish_reason == "stop"
        assert cut.message.content == full[: full.index(stop)].strip()
        rid = running_rollout(store)
        _client(server.url, rid).chat.completions.create(**ask, stop=stop)
        span = store.spans(rid)[0]
        text = tokenizer.decode(span.completion_ids)
        assert stop in text  # the span keeps every sampled token, the stop string included
    finally:
        server.stop()
        engine.close()
        store.close()
