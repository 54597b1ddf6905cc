"""A real pretrained model, SmolLM2-135M-Instruct (its Q4_1 GGUF dequantized: the quantized
model's weights), served through the gateway: plain chat answered, a tool call rendered the
Hermes way for its tool-less template and recorded with exact ids across two turns, and a
prompt beyond its 8,192 positions refused with the API's own error before any sampling; one RL step on a recorded call, and the model it exports loads."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tracerl.stack import LocalStack, start_multi_stack
from tracerl.store.sessions import session_task_id

pytestmark = pytest.mark.slow

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


@pytest.fixture(scope="module")
def smollm2_stack(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    """The gateway serving the converted model as "policy", recording into SQLite."""
    db = tmp_path_factory.mktemp("smollm2") / "traces.db"
    stack = start_multi_stack({"policy": smollm2_dir}, {"policy": "policy"}, db)
    yield stack
    stack.close()


def _chat(stack: LocalStack, body: dict, session: str) -> httpx.Response:  # type: ignore[type-arg]
    headers = {"X-Tracerl-Session": session}
    return httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=300)


def test_a_tool_call_is_recorded_with_exact_ids_across_turns(smollm2_stack: LocalStack) -> None:
    stack = smollm2_stack
    messages = [{"role": "user", "content": "What is 17 + 25? Use the add tool."}]
    first = {"model": "policy", "messages": messages, "tools": TOOLS, "tool_choice": "required",
             "max_tokens": 48, "temperature": 0}  # fmt: skip
    reply = _chat(stack, first, "tool-call")
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "add"
    json.loads(call["function"]["arguments"])
    history = [*messages, message, {"role": "tool", "tool_call_id": call["id"], "content": "42"}]
    second = {**first, "messages": history, "max_tokens": 16}
    del second["tool_choice"]
    reply = _chat(stack, second, "tool-call")
    assert reply.status_code == 200, reply.text
    [rollout] = stack.store.rollouts(task_id=session_task_id("tool-call"))
    s0, s1 = stack.store.spans(rollout.id)
    tokenizer = stack.gateway.models["policy"].tokenizer
    prompt = tokenizer.decode(s0.prompt_ids)
    assert "<tools>" in prompt and '"name": "add"' in prompt
    assert s0.response["tool_rendering"] == s1.response["tool_rendering"] == "hermes-fallback"
    assert "<tool_response>\n42\n</tool_response>" in tokenizer.decode(s1.prompt_ids)
    # Token-in/token-out: the second prompt extends the first prompt and its sampled ids.
    assert s1.prefix_break is None
    assert s1.prompt_ids[: len(s0.prompt_ids) + len(s0.completion_ids)] == (
        s0.prompt_ids + s0.completion_ids
    )
    for span in (s0, s1):
        assert span.completion_ids and len(span.logprobs) == len(span.completion_ids)


def test_plain_chat_and_the_context_limit(smollm2_stack: LocalStack) -> None:
    stack = smollm2_stack
    ask = {"model": "policy", "messages": [{"role": "user", "content": "What is the capital of "
           "France?"}], "max_tokens": 12, "temperature": 0}  # fmt: skip
    reply = _chat(stack, ask, "plain")
    assert reply.status_code == 200, reply.text
    assert "Paris" in reply.json()["choices"][0]["message"]["content"]
    # The limit is the model's own, read from its config: 8,192 positions.
    assert stack.gateway.models["policy"].engine.max_context == 8192
    long = {**ask, "messages": [{"role": "user", "content": "word " * 9000}]}
    started = time.perf_counter()
    reply = _chat(stack, long, "plain")
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and "8192" in error["message"]
    assert time.perf_counter() - started < 5


def test_one_rl_step_on_its_recorded_call_and_the_export_loads(
    smollm2_stack: LocalStack, smollm2_dir: Path, tmp_path: Path
) -> None:
    """The recorded call trains: one step with a finite loss that changes the weights, and the
    model it writes loads in plain transformers with those weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from tracerl.algorithms.transitions import spans_to_transitions
    from tracerl.trainer.config import TrainerConfig
    from tracerl.trainer.trainer import Trainer

    stack = smollm2_stack
    ask = {"model": "policy", "messages": [{"role": "user", "content": "What is 3 + 4? Use the "
           "add tool."}], "tools": TOOLS, "max_tokens": 32, "temperature": 1.0}  # fmt: skip
    assert _chat(stack, ask, "rl-step").status_code == 200
    [rollout] = stack.store.rollouts(task_id=session_task_id("rl-step"))
    [row] = spans_to_transitions(stack.store.spans(rollout.id), 1.0, group_id="g", task_id="t")
    row = row.model_copy(update={"advantages": [float(m) for m in row.loss_mask]})
    trainer = Trainer(smollm2_dir, TrainerConfig(lr=1e-5), "cpu")
    weight = trainer.model.get_parameter("model.layers.0.self_attn.q_proj.weight")
    before = weight.detach().clone()
    metrics = trainer.train([row])
    assert metrics.optimizer_steps == 1 and metrics.nonfinite_steps == 0
    assert torch.isfinite(torch.tensor(metrics.loss)) and metrics.trained_tokens > 0
    assert not torch.equal(weight.detach(), before)
    trainer.save_model(tmp_path / "model")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    got = exported.get_parameter("model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(got, weight.detach())
