"""Tool-call formats of real model families: each parser on well-formed, multiple and
malformed calls; the format read off a chat template written in each family's style; and
the gateway turning each family's text into OpenAI tool calls while the span keeps the
model's own ids; each role of a stack reading replies in the format its config names."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

import tracerl.stack
from tracerl.engines.stub import StubEngine
from tracerl.entrypoints.config import ServingConfig
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.gateway.toolcalls import FORMATS, detect, parse_reply
from tracerl.pipeline.run import start_roles_stack
from tracerl.roles import remote_roles
from tracerl.server import serve_in_thread
from tracerl.stack import LocalStack
from tracerl.store.sqlite import SqliteStore

from .scripted import running_rollout

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "shell",
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string"}},
                "required": ["cmd"],
            },
        },
    },
]
ADD = {"name": "add", "arguments": {"a": 1, "b": 2}}
SHELL = {"name": "shell", "arguments": {"cmd": "ls -l"}}

# Two calls, in each family's own spelling.
TWO_CALLS = {
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "shell", "arguments": {"cmd": "ls -l"}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
    "<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=shell>\n<parameter=cmd>\nls -l\n</parameter>\n</function>\n"
    "</tool_call>",
    "llama3": '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
    '{"name": "shell", "parameters": {"cmd": "ls -l"}}',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
    '{"name": "shell", "arguments": {"cmd": "ls -l"}}]',
}
BROKEN = {
    "hermes": '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=add>\n<parameter=a>\n1\n</function>\n</tool_call>",
    "llama3": '{"name": "add", "parameters": {"a": 1}',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}]',
}


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_two_calls_parse_in_order(family: str) -> None:
    reply = parse_reply(TWO_CALLS[family], TOOLS, FORMATS[family])
    assert reply.tool_calls == [ADD, SHELL]
    assert reply.content == ""


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_malformed_call_is_the_raw_text(family: str) -> None:
    reply = parse_reply(BROKEN[family], TOOLS, FORMATS[family])
    assert reply.tool_calls == []
    assert reply.content == BROKEN[family].strip()


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_without_tools_nothing_is_parsed(family: str) -> None:
    reply = parse_reply(TWO_CALLS[family], None, FORMATS[family])
    assert reply.tool_calls == [] and reply.content == TWO_CALLS[family].strip()


def test_content_around_calls_is_kept() -> None:
    hermes = parse_reply(
        'Let me add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
        TOOLS,
    )
    assert hermes.content == "Let me add." and hermes.tool_calls == [ADD]
    mistral = parse_reply(
        'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
        TOOLS,
        FORMATS["mistral"],
    )
    assert mistral.content == "Sure." and mistral.tool_calls == [ADD]
    # Llama's calls are the whole reply: a sentence mentioning JSON is content.
    llama = parse_reply('I would send {"name": "add"} here', TOOLS, FORMATS["llama3"])
    assert llama.tool_calls == [] and llama.content.startswith("I would")


def test_family_variants() -> None:
    # Mistral tokenizer v11+: one marker per call, NAME{args} or NAME[ARGS]{args}.
    v11 = '[TOOL_CALLS]add{"a": 1, "b": 2}[TOOL_CALLS]shell[ARGS]{"cmd": "ls -l"}'
    assert parse_reply(v11, TOOLS, FORMATS["mistral"]).tool_calls == [ADD, SHELL]
    # Llama 3.2+ templates write "arguments"; no python tag.
    llama = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    assert parse_reply(llama, TOOLS, FORMATS["llama3"]).tool_calls == [ADD]
    # Qwen3-Coder: a string parameter stays a string even when it spells a number.
    coder = "<tool_call>\n<function=shell>\n<parameter=cmd>\n42\n</parameter>\n</function>\n</tool_call>"
    assert parse_reply(coder, TOOLS, FORMATS["qwen3_coder"]).tool_calls == [
        {"name": "shell", "arguments": {"cmd": "42"}}
    ]
    # Hermes arguments given as a JSON string are read as the object they spell.
    hermes = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert parse_reply(hermes, TOOLS).tool_calls == [ADD]


# Chat templates in each family's style: the tools, a plain conversation, and assistant tool
# calls spelled the family's way (the detail detection reads). A template that showed no
# tools would get the gateway's Hermes rendering instead (test_tool_rendering.py).
_LOOP = (
    "{%- if tools -%}{{ '<|system|>' ~ (tools | tojson) ~ '<|end|>' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and m['tool_calls'] -%}"
    "{{ '<|assistant|>' }}{%- for c in m['tool_calls'] -%}CALL{%- endfor -%}{{ '<|end|>' }}"
    "{%- else -%}{{ '<|' ~ m['role'] ~ '|>' ~ m['content'] ~ '<|end|>' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)
_CALLS = {
    "hermes": "{{ '<tool_call>\\n' ~ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson ~ '\\n</tool_call>' }}",
    "qwen3_coder": "{{ '<tool_call>\\n<function=' ~ c.function.name ~ '>\\n' }}"
    "{%- for k, v in c.function.arguments.items() -%}"
    "{{ '<parameter=' ~ k ~ '>\\n' ~ v ~ '\\n</parameter>\\n' }}{%- endfor -%}"
    "{{ '</function>\\n</tool_call>' }}",
    "llama3": "{{ '<|python_tag|>' ~ {'name': c.function.name, 'parameters':"
    " c.function.arguments} | tojson }}",
    "mistral": "{{ '[TOOL_CALLS]' ~ [{'name': c.function.name, 'arguments':"
    " c.function.arguments}] | tojson }}",
}
TEMPLATES = {family: _LOOP.replace("CALL", call) for family, call in _CALLS.items()}


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_family_read_off_its_chat_template(family: str, tiny_model_dir: Path) -> None:
    assert detect(TEMPLATES[family]).name == family
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = TEMPLATES[family]
    assert ServedModel("m", StubEngine(tokenizer=tokenizer), tokenizer).tool_format.name == family
    # The setting wins over the template; no sign at all means Hermes.
    named = ServedModel("m", StubEngine(tokenizer=tokenizer), tokenizer, tool_parser="mistral")
    assert named.tool_format.name == "mistral"
    assert detect("{{ messages }}").name == "hermes"


def test_unknown_tool_parser_is_refused(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="unknown tool_parser"):
        ServedModel("m", StubEngine(tokenizer=tokenizer), tokenizer, tool_parser="nope")


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_gateway_returns_openai_tool_calls(family: str, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = TEMPLATES[family]
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    ids = [*tokenizer.encode(TWO_CALLS[family], add_special_tokens=False), end]
    engine = StubEngine(ids, eos_token_ids=[end], tokenizer=tokenizer)
    store = SqliteStore(":memory:")
    gateway = Gateway(store, {"policy": ServedModel("policy", engine, tokenizer)})
    server = serve_in_thread(create_app(gateway))
    try:
        rid = running_rollout(store)
        body = {"model": "policy", "messages": [{"role": "user", "content": "go"}], "tools": TOOLS}
        reply = httpx.post(f"{server.url}/rollouts/{rid}/v1/chat/completions", json=body).json()
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        calls = choice["message"]["tool_calls"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("add", {"a": 1, "b": 2}),
            ("shell", {"cmd": "ls -l"}),
        ]
        assert not choice["message"]["content"]
        # Only the reply's shape changed: the span holds the model's ids as sampled.
        (span,) = store.spans(rid)
        assert span.completion_ids == ids
        # The agent echoes the calls back: the family's template re-renders them and the
        # gateway accepts the conversation (token-in/token-out or a recorded prefix break).
        history = [*body["messages"], choice["message"]]
        history += [{"role": "tool", "tool_call_id": c["id"], "content": "3"} for c in calls]
        again = httpx.post(
            f"{server.url}/rollouts/{rid}/v1/chat/completions", json={**body, "messages": history}
        )
        assert again.status_code == 200
    finally:
        server.stop()
        store.close()


def _stack_answering(text: str, cfg: ServingConfig, monkeypatch, tmp_path: Path) -> LocalStack:  # type: ignore[no-untyped-def]
    """The stack `cfg` serves (as `tracerl serve` and `eval` build it), every engine a stub
    that answers `text`."""
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    ids = [*tokenizer.encode(text, add_special_tokens=False), end]
    stub = StubEngine(ids, eos_token_ids=[end], tokenizer=tokenizer)
    monkeypatch.setattr(tracerl.stack, "make_engine", lambda *args, **kwargs: stub)
    remote = remote_roles(cfg.roles, cfg.reply_format())
    return start_roles_stack(cfg.policies("serve"), remote, tmp_path / "s.db", cfg.engine)


def _ask(stack: LocalStack, model: str) -> dict:  # type: ignore[type-arg]
    rid = running_rollout(stack.store)
    body = {"model": model, "messages": [{"role": "user", "content": "go"}], "tools": TOOLS}
    reply = httpx.post(f"{stack.url}/rollouts/{rid}/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    (span,) = stack.store.spans(rid)
    return {**reply.json()["choices"][0], "span_ids": span.completion_ids}


def test_each_role_of_a_stack_parses_replies_in_its_own_format(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    model = str(tiny_model_dir)
    assert detect(AutoTokenizer.from_pretrained(model).chat_template).name == "hermes"
    # One policy, two roles: the planner's replies are read as Llama 3 calls, the
    # executor's (same engine, same ids) in the format its chat template shows.
    roles = {"planner": {"tool_parser": "llama3"}, "executor": {"share": "planner"}}
    cfg = ServingConfig.model_validate({"model": model, "roles": roles})
    stack = _stack_answering(TWO_CALLS["llama3"], cfg, monkeypatch, tmp_path)
    try:
        planner, executor = _ask(stack, "planner"), _ask(stack, "executor")
    finally:
        stack.close()
    assert planner["finish_reason"] == "tool_calls"
    calls = planner["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("shell", {"cmd": "ls -l"}),
    ]
    assert executor["finish_reason"] == "stop" and not executor["message"].get("tool_calls")
    assert executor["message"]["content"] == TWO_CALLS["llama3"]
    assert planner["span_ids"] == executor["span_ids"]  # parsing never touches the ids


def test_configured_thinking_markers_split_reasoning_off(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # The run's markers serve every role that sets none; a role's own replace them.
    roles = {"a": {}, "b": {"share": "a", "thinking": ["<r>", "</r>"]}}
    plan = ["<plan>", "</plan>"]
    cfg = ServingConfig.model_validate(
        {"model": str(tiny_model_dir), "roles": roles, "thinking": plan}
    )
    stack = _stack_answering("<plan>I add 1 and 2.</plan>3", cfg, monkeypatch, tmp_path)
    try:
        a, b = _ask(stack, "a")["message"], _ask(stack, "b")["message"]
    finally:
        stack.close()
    assert (a["reasoning_content"], a["content"]) == ("I add 1 and 2.", "3")
    assert not b.get("reasoning_content") and b["content"] == "<plan>I add 1 and 2.</plan>3"
