"""The long-context test model: 32k RoPE positions, an 8k vocabulary that packs an agent's
prompt into a few thousand tokens, the chat template rendering every part of an agent
conversation, long prompts served, and prompts beyond the context refused by each API."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from transformers import AutoConfig, AutoTokenizer

from tracerl.models.longctx import LONG_CONTEXT, corpus
from tracerl.stack import LocalStack

from .longctx import all_spans, check_recorded, long_model_dir, long_stack  # noqa: F401

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": "Run a shell command in the workspace and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
            },
        },
    }
    for i in range(20)
]


def _agent_prompt(chars: int) -> str:
    """Instructions and code like a coding agent's system prompt, `chars` long."""
    text = (
        "You are a coding agent working in the user's repository. Read files before editing "
        "them, run the tests after each change, and explain what you changed.\n"
        "def handler(request):\n    return {'status': 200, 'body': request.json()}\n"
        + json.dumps(TOOLS[0])
        + "\n"
    )
    return (text * (chars // len(text) + 1))[:chars]


def test_config_and_vocabulary(long_model_dir: Path) -> None:  # noqa: F811
    config = AutoConfig.from_pretrained(long_model_dir)
    assert config.max_position_embeddings == 32768 == LONG_CONTEXT.max_position
    assert config.model_type == "llama"  # rotary position embeddings
    tokenizer = AutoTokenizer.from_pretrained(long_model_dir)
    assert len(tokenizer) >= 8000
    # A 40k-character agent prompt takes a few thousand tokens (the demo model's ~400-token
    # vocabulary needs about four times as many).
    n = len(tokenizer(_agent_prompt(40_000))["input_ids"])
    assert 2_000 <= n <= 12_000, n


def test_template_renders_a_whole_agent_conversation(long_model_dir: Path) -> None:  # noqa: F811
    tokenizer = AutoTokenizer.from_pretrained(long_model_dir)
    call = {"type": "function", "function": {"name": "tool_3", "arguments": {"command": "ls"}}}
    messages = [
        {"role": "system", "content": "SYSTEM-TEXT"},
        {"role": "user", "content": "USER-TEXT"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "TOOL-RESULT"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    for part in ("SYSTEM-TEXT", "USER-TEXT", "TOOL-RESULT", "tool_19(command,timeout)"):
        assert part in text
    assert '<tool_call>{"name": "tool_3", "arguments": {"command": "ls"}}</tool_call>' in text


def test_corpus_holds_code_english_and_schemas() -> None:
    texts = list(corpus())
    assert any("def " in t for t in texts) and any('"parameters"' in t for t in texts)


def test_long_prompt_served_and_recorded(long_stack: LocalStack) -> None:  # noqa: F811
    messages = [
        {"role": "system", "content": _agent_prompt(40_000)},
        {"role": "user", "content": "List the files."},
    ]
    body = {"model": "policy", "messages": messages, "tools": TOOLS, "max_tokens": 16}
    r = httpx.post(
        f"{long_stack.url}/v1/chat/completions",
        json=body,
        headers={"X-Tracerl-Session": "long"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    spans = all_spans(long_stack)
    check_recorded(spans)
    assert len(spans[0].prompt_ids) == r.json()["usage"]["prompt_tokens"] > 2_000


def test_beyond_the_context_each_api_answers_its_own_400(long_stack: LocalStack) -> None:  # noqa: F811
    huge = _agent_prompt(400_000)  # far over 32,768 tokens
    url = long_stack.url
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": huge}]},
        timeout=120,
    )
    assert chat.status_code == 400
    assert chat.json()["error"]["code"] == "context_length_exceeded"
    assert "32768" in chat.json()["error"]["message"]
    resp = httpx.post(f"{url}/v1/responses", json={"model": "policy", "input": huge}, timeout=120)
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "context_length_exceeded"
    body = {"model": "claude-x", "max_tokens": 8, "messages": [{"role": "user", "content": huge}]}
    msg = httpx.post(f"{url}/v1/messages", json=body, timeout=120)
    assert msg.status_code == 400
    assert msg.json()["type"] == "error"
    assert msg.json()["error"]["type"] == "invalid_request_error"
    assert "32768" in msg.json()["error"]["message"]
    assert all_spans(long_stack) == []  # refused before sampling: nothing recorded
