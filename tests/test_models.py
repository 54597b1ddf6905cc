"""Tests for tracerl.models (template, tokenizer, tiny model, SFT) and the calculator expert."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracerl.models import (
    SPECIAL_TOKENS,
    Demo,
    SftConfig,
    TinyModelConfig,
    build_tiny_model,
    encode_demo,
    format_tool_call,
    load_demos,
    render_chat,
    sft,
    train_tokenizer,
)

CALC = Path(__file__).resolve().parent.parent / "examples" / "calculator"
sys.path.insert(0, str(CALC))
from agent import SYSTEM_PROMPT, TOOLS  # noqa: E402
from expert import demonstrations  # noqa: E402

SMALL = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def _conversation(arguments: str | dict) -> list[dict]:
    call = {
        "id": "c0",
        "type": "function",
        "function": {"name": "calculator", "arguments": arguments},
    }
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "What is 37+48?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0", "content": "85"},
        {"role": "assistant", "content": "85"},
    ]


EXPECTED = (
    "<|system|>Use the calculator, then answer with the number.\nTools: calculator(expression)"
    "<|end|><|user|>What is 37+48?<|end|><|assistant|><tool_call>"
    '{"name": "calculator", "arguments": {"expression": "37+48"}}</tool_call><|end|>'
    "<|tool|>85<|end|><|assistant|>85<|end|>"
)


@pytest.fixture(scope="module")
def demos() -> list[Demo]:
    return [Demo.model_validate(d) for d in demonstrations(8, seed=5, noise=0.0)]


@pytest.fixture(scope="module")
def tokenizer(demos):
    return train_tokenizer([render_chat(d.messages, d.tools) for d in demos], vocab_size=300)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, demos) -> Path:
    texts = [render_chat(d.messages, d.tools) for d in demos]
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), texts, SMALL)


@pytest.mark.parametrize("arguments", [{"expression": "37+48"}, '{"expression": "37+48"}'])
def test_template_renders_calculator_conversation_exactly(tokenizer, arguments):
    messages = _conversation(arguments)
    assert tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False) == EXPECTED
    assert render_chat(messages, TOOLS) == EXPECTED
    assert format_tool_call("calculator", {"expression": "37+48"}) in EXPECTED


def test_template_prefixes_are_string_prefixes(tokenizer):
    messages = _conversation({"expression": "37+48"})
    full = render_chat(messages, TOOLS)
    for i in range(1, len(messages)):
        assert full.startswith(render_chat(messages[:i], TOOLS))
        if messages[i]["role"] == "assistant":
            assert full.startswith(render_chat(messages[:i], TOOLS, add_generation_prompt=True))


def test_template_tools_without_system_and_plain_chat(tokenizer):
    user = [{"role": "user", "content": "hi"}]
    two = [*TOOLS, {"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert render_chat(user, two, add_generation_prompt=True) == (
        "<|system|>Tools: calculator(expression); f()<|end|><|user|>hi<|end|><|assistant|>"
    )
    assert render_chat(user) == "<|user|>hi<|end|>"


def test_tokenizer_digits_special_tokens_and_padding(tokenizer, tmp_path):
    tokens = tokenizer.tokenize("x 12345")
    assert [t for t in tokens if t.strip("Ġ").isdigit()] == list("12345")
    for special in SPECIAL_TOKENS:
        assert tokenizer.tokenize(f"a{special}b")[1] == special
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.padding_side == "left"
    assert (loaded.eos_token, loaded.pad_token) == ("<|end|>", "<|pad|>")
    assert loaded.decode(loaded(EXPECTED)["input_ids"]) == EXPECTED  # no bos/eos added, lossless
    assert loaded.apply_chat_template(_conversation({"expression": "1"}), tokenize=False)


def test_build_tiny_model_round_trips_and_is_deterministic(tiny_dir, demos, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    prompts = ["<|user|>What is 1+2?<|end|><|assistant|>", "<|user|>hi<|end|><|assistant|>"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    out_BT = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out_BT.shape[0] == 2
    again = build_tiny_model(tmp_path, [render_chat(d.messages, d.tools) for d in demos], SMALL)
    twin = AutoModelForCausalLM.from_pretrained(again)
    for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_loss_mask_covers_exactly_the_assistant_turns(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    demo = Demo(messages=_conversation('{"expression": "37+48"}'), tools=TOOLS)
    encoded = encode_demo(tokenizer, demo)
    assert encoded.input_ids == tokenizer(EXPECTED, add_special_tokens=False)["input_ids"]
    masked = [i for i, m in zip(encoded.input_ids, encoded.loss_mask, strict=True) if m]
    call = format_tool_call("calculator", {"expression": "37+48"})
    assert tokenizer.decode(masked) == f"{call}<|end|>85<|end|>"


def test_sft_loss_decreases_and_saves_a_loadable_dir(tiny_dir, demos, tmp_path):
    cfg = SftConfig(steps=20, batch_size=4, lr=1e-2, warmup=2, stop_loss=None, progress=False)
    result = sft(tiny_dir, demos, tmp_path / "out", cfg)
    assert result.steps == 20 and not result.stopped_early
    assert sum(result.losses[-5:]) < 0.7 * sum(result.losses[:5])
    assert result.tokens_per_s > 0
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert AutoTokenizer.from_pretrained(tmp_path / "out").padding_side == "left"


def test_sft_stops_at_the_loss_threshold(tiny_dir, demos, tmp_path):
    cfg = SftConfig(steps=50, batch_size=4, lr=1e-2, stop_loss=100.0, progress=False)
    result = sft(tiny_dir, demos, tmp_path / "out", cfg)
    assert result.stopped_early and result.steps == cfg.log_every


def test_expert_demos_are_correct_without_noise_and_load_from_jsonl(tmp_path):
    out = tmp_path / "demos.jsonl"
    script = CALC / "expert.py"
    subprocess.run([sys.executable, str(script), "50", str(out), "7"], check=True)
    loaded = load_demos(out)
    assert len(loaded) == 50 and loaded[0].tools == TOOLS
    for raw in demonstrations(50, seed=7, noise=0.0):
        system, user, call, tool, answer = raw["messages"]
        expression = user["content"].removeprefix("What is ").removesuffix("?")
        assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {
            "expression": expression
        }
        assert answer["content"] == tool["content"] == str(eval(expression))  # noqa: S307
    noisy = demonstrations(400, seed=7, noise=0.5)
    wrong = sum(
        d["messages"][-1]["content"] != str(eval(d["messages"][1]["content"][8:-1])) for d in noisy
    )  # noqa: S307
    assert 100 < wrong < 300
    with pytest.raises(ValueError):
        demonstrations(5, seed=1)


def test_expert_does_not_import_tracerl():
    code = f"import sys; sys.path.insert(0, {str(CALC)!r}); import expert; print('tracerl' in sys.modules)"
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "False"
    )
