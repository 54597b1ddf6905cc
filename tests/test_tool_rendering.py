"""Tools for a chat template that ignores them (SmolLM2's ChatML has no tool support): the
gateway renders them the Hermes way (tools in the system message, calls as <tool_call>
blocks, results as <tool_response> in a user turn), parses replies with the Hermes parser,
says so on the span, and keeps token-in/token-out across turns. A template that renders
tools itself is left alone."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tracerl.engines.stub import StubEngine
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.gateway.tito import PromptBuilder
from tracerl.gateway.toolcalls import parse_reply
from tracerl.models.sft import Demo, encode_demo
from tracerl.server import serve_in_thread
from tracerl.store.sqlite import SqliteStore

from .scripted import running_rollout

# SmolLM2-135M-Instruct's chat template, as its GGUF carries it: ChatML, no tools.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The same shape in the tiny tokenizer's own special tokens, so prompts tokenize cleanly.
NO_TOOLS = (
    "{% for m in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|system|>You are a helpful assistant.<|end|>' }}{% endif %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def _tokenizer(model_dir: Path, template: str | None):  # type: ignore[no-untyped-def]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def _gateway(tokenizer, store: SqliteStore) -> Gateway:  # type: ignore[no-untyped-def]
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    ids = [*tokenizer.encode(CALL, add_special_tokens=False), end]
    engine = StubEngine(ids, eos_token_ids=[end], tokenizer=tokenizer)
    return Gateway(store, {"policy": ServedModel("policy", engine, tokenizer)})


def test_the_rendering_is_read_off_the_template(tiny_model_dir: Path) -> None:
    assert PromptBuilder(_tokenizer(tiny_model_dir, None)).tool_rendering == "template"
    for template in (SMOLLM2_TEMPLATE, NO_TOOLS):
        builder = PromptBuilder(_tokenizer(tiny_model_dir, template))
        assert builder.tool_rendering == "hermes-fallback"


def test_a_template_without_tools_gets_them_the_hermes_way_across_turns(
    tiny_model_dir: Path,
) -> None:
    tokenizer = _tokenizer(tiny_model_dir, NO_TOOLS)
    store = SqliteStore(":memory:")
    server = serve_in_thread(create_app(_gateway(tokenizer, store)))
    try:
        rid = running_rollout(store)
        url = f"{server.url}/rollouts/{rid}/v1/chat/completions"
        messages = [{"role": "user", "content": "What is 1+2?"}]
        first = httpx.post(url, json={"model": "policy", "messages": messages, "tools": TOOLS})
        assert first.status_code == 200, first.text
        choice = first.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
            "add",
            {"a": 1, "b": 2},
        )
        history = [
            *messages,
            choice["message"],
            {"role": "tool", "tool_call_id": call["id"], "content": "3"},
        ]
        second = httpx.post(url, json={"model": "policy", "messages": history, "tools": TOOLS})
        assert second.status_code == 200, second.text
    finally:
        server.stop()
    s0, s1 = store.spans(rid)
    prompt = tokenizer.decode(s0.prompt_ids, skip_special_tokens=False)
    # The tools reached the model: listed in a system message, with how to call them.
    assert "<tools>" in prompt and '"name": "add"' in prompt and "<tool_call>" in prompt
    assert s0.response["tool_rendering"] == "hermes-fallback"
    # The tool result is a <tool_response> in a user turn; the second prompt extends the
    # first prompt and its sampled ids exactly (no prefix break).
    text = tokenizer.decode(s1.prompt_ids, skip_special_tokens=False)
    assert "<|user|><tool_response>\n3\n</tool_response><|end|>" in text
    assert s1.prefix_break is None
    assert s1.prompt_ids[: s1.prefix_reused] == s0.prompt_ids + s0.completion_ids
    assert s1.prefix_reused == len(s0.prompt_ids) + len(s0.completion_ids)
    store.close()


def test_the_fallback_renders_prefix_stably(tiny_model_dir: Path) -> None:
    builder = PromptBuilder(_tokenizer(tiny_model_dir, NO_TOOLS))
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "add", "arguments": {"a": i}}}
        for i in range(2)
    ]
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add."},
        {"role": "assistant", "content": "Adding.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c0", "content": "0"},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "assistant", "content": "Both done."},
        {"role": "user", "content": "Thanks."},
    ]
    full = builder.render(turns, TOOLS, gen=True)
    for k in (3, 6):
        assert full.startswith(builder.render(turns[:k], TOOLS, gen=False))
    # The given system message keeps its text, the tools follow it; both results share
    # one user turn; the assistant's calls are its text.
    assert full.startswith("<|system|>Be brief.\n\n# Tools\n")
    assert "<tool_response>\n0\n</tool_response>\n<tool_response>\n1\n</tool_response>" in full
    assert '<|assistant|>Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 0}}' in full
    # Without tools the conversation renders as the template has it.
    plain = [{"role": "user", "content": "Hi."}]
    assert builder.render(plain, None, gen=True) == (
        "<|system|>You are a helpful assistant.<|end|><|user|>Hi.<|end|><|assistant|>"
    )


def test_a_template_with_tools_keeps_its_own_rendering(tiny_model_dir: Path) -> None:
    tokenizer = _tokenizer(tiny_model_dir, None)
    store = SqliteStore(":memory:")
    server = serve_in_thread(create_app(_gateway(tokenizer, store)))
    try:
        rid = running_rollout(store)
        body = {"model": "policy", "messages": [{"role": "user", "content": "go"}], "tools": TOOLS}
        reply = httpx.post(f"{server.url}/rollouts/{rid}/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
    finally:
        server.stop()
    (span,) = store.spans(rid)
    assert span.response["tool_rendering"] == "template"
    assert "<tools>" not in tokenizer.decode(span.prompt_ids, skip_special_tokens=False)
    store.close()


def test_a_non_hermes_parser_for_a_template_without_tools_is_refused(
    tiny_model_dir: Path,
) -> None:
    tokenizer = _tokenizer(tiny_model_dir, NO_TOOLS)
    engine = StubEngine(tokenizer=tokenizer)
    with pytest.raises(ValueError, match="ignores tools"):
        ServedModel("m", engine, tokenizer, tool_parser="llama3")
    assert ServedModel("m", engine, tokenizer, tool_parser="hermes").tool_format.name == "hermes"


def test_responses_and_messages_routes_render_the_tools_too(tiny_model_dir: Path) -> None:
    tokenizer = _tokenizer(tiny_model_dir, NO_TOOLS)
    store = SqliteStore(":memory:")
    server = serve_in_thread(create_app(_gateway(tokenizer, store)))
    fn = TOOLS[0]["function"]
    try:
        rid = running_rollout(store)
        base = f"{server.url}/rollouts/{rid}/v1"
        responses = {
            "model": "policy",
            "input": "What is 1+2?",
            "tools": [{"type": "function", **fn}],
        }
        assert httpx.post(f"{base}/responses", json=responses).status_code == 200
        anthropic_tool = {"name": fn["name"], "input_schema": fn["parameters"]}
        messages = {
            "model": "policy",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "What is 1+2?"}],
            "tools": [anthropic_tool],
        }
        assert httpx.post(f"{base}/messages", json=messages).status_code == 200
    finally:
        server.stop()
    for span in store.spans(rid):
        assert "<tools>" in tokenizer.decode(span.prompt_ids, skip_special_tokens=False)
        assert span.response["tool_rendering"] == "hermes-fallback"
    store.close()


def test_a_block_holding_a_list_of_calls_is_read() -> None:
    # SmolLM2's own convention: one <tool_call> block holding a JSON list of calls.
    text = (
        '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "add", "arguments": {"a": 3, "b": 4}}]</tool_call>'
    )
    calls = parse_reply(text, TOOLS).tool_calls
    assert calls == [
        {"name": "add", "arguments": {"a": 1, "b": 2}},
        {"name": "add", "arguments": {"a": 3, "b": 4}},
    ]
    for kept in ("<tool_call>[]</tool_call>", '<tool_call>[{"name": "add"}, 3]</tool_call>'):
        assert (
            parse_reply(kept, TOOLS).tool_calls == [] and parse_reply(kept, TOOLS).content == kept
        )


def test_sft_renders_a_demo_as_the_gateway_renders_its_request(tiny_model_dir: Path) -> None:
    """A demo with tools on a template that ignores them is trained on the Hermes rendering
    the gateway serves; the loss covers the call's text and the answer, and the ids the
    gateway would build for the second turn's prompt are the demo's own prefix."""
    tokenizer = _tokenizer(tiny_model_dir, NO_TOOLS)
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    }
    demo = Demo(
        messages=[
            {"role": "user", "content": "What is 1+2?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
            {"role": "assistant", "content": "3"},
        ],
        tools=TOOLS,
    )
    encoded = encode_demo(tokenizer, demo)
    text = tokenizer.decode(encoded.input_ids)
    assert "<tools>" in text and CALL in text and "<tool_response>\n3\n</tool_response>" in text
    trained = tokenizer.decode(
        [i for i, m in zip(encoded.input_ids, encoded.loss_mask, strict=True) if m]
    )
    assert CALL in trained and trained.endswith("3<|end|>") and "<tools>" not in trained
    builder = PromptBuilder(tokenizer)
    # The gateway's canonical messages carry a call's arguments as an object.
    called = {**call, "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    history = [demo.messages[0], {"role": "assistant", "content": "", "tool_calls": [called]}]
    second = builder.render([*history, demo.messages[2]], TOOLS, True)
    assert text.startswith(second) and builder.tool_rendering == "hermes-fallback"
