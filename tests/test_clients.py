"""Official clients, unchanged, against a real gateway serving the warm-started tiny
calculator model: the openai SDK (chat completions and Responses, streamed and not), the
anthropic SDK (Messages with tools, streamed and not) and openai-agents (its default
Responses model with a function tool). Each runs a multi-turn tool-using exchange under its
own rollout; every call must be a span with token ids, each later call must extend the
earlier ones token for token (0 prefix breaks), and re-scoring every span with the same
weights must reproduce its log-probs (<= 1e-4)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tracerl.engines.hf import HFEngine
from tracerl.engines.scoring import score_completion
from tracerl.examples import example_module
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store.sqlite import SqliteStore
from tracerl.types import Task

calc = example_module("calculator", "agent")
SYSTEM, QUESTION = calc.SYSTEM_PROMPT, "What is 37+48?"
FN = calc.TOOLS[0]["function"]


class Stack:
    """A gateway serving the calculator model, with its store and scorer."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = HFEngine(model_dir, max_batch_size=4)
        self.store = SqliteStore(":memory:")
        self.store.add_tasks([Task(id="t", input={"question": QUESTION}, answer=85)])
        served = {"policy": ServedModel("policy", self.engine, self.engine.tokenizer)}
        gateway = Gateway(self.store, served, default_model="policy")
        self.server: BackgroundServer = serve_in_thread(create_app(gateway))
        self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()

    def rollout(self) -> str:
        self.store.enqueue(["t"])
        return self.store.claim("clients-test", 1, 600.0)[0].id

    def base(self, rollout_id: str) -> str:
        return f"{self.server.url}/rollouts/{rollout_id}"

    def check(self, rollout_id: str) -> None:
        """Multi-turn, token ids reused whole, log-probs reproduced."""
        spans = self.store.spans(rollout_id)
        assert len(spans) >= 2, f"{len(spans)} call(s): not a multi-turn exchange"
        for before, after in zip(spans, spans[1:], strict=False):
            seen = before.prompt_ids + before.completion_ids
            assert after.prompt_ids[: len(seen)] == seen and after.prefix_break is None
        for span in spans:
            assert span.completion_ids and span.policy_version == 0
            got = score_completion(self.model, span.prompt_ids, span.completion_ids, 0.0)
            assert max(abs(a - b) for a, b in zip(got, span.logprobs, strict=True)) <= 1e-4


@pytest.fixture(scope="module")
def stack(calculator_skilled_dir: Path) -> Iterator[Stack]:
    s = Stack(calculator_skilled_dir)
    yield s
    s.server.stop()
    s.engine.close()
    s.store.close()


def _exchange(turn: Callable[[list[Any]], tuple[list[Any], list[tuple[str, str]]]]) -> None:
    """Call the model until it stops calling the calculator (at most 4 turns): `turn` takes
    the history, returns the history grown by the reply and the (call id, expression) asked."""
    history: list[Any] = []
    for _ in range(4):
        history, calls = turn(history)
        if not calls:
            return
        history = history + [("result", cid, calc.calculate(expr)) for cid, expr in calls]
    raise AssertionError("the model never stopped calling the calculator")


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_completions(stack: Stack, stream: bool) -> None:
    rid = stack.rollout()
    client = openai.OpenAI(base_url=f"{stack.base(rid)}/v1", api_key="x", max_retries=0)
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
    ]
    for _ in range(4):
        kwargs = {"model": "gpt-5", "messages": messages, "tools": calc.TOOLS, "temperature": 0}
        if stream:
            with client.chat.completions.stream(**kwargs) as s:  # type: ignore[arg-type]
                message = s.get_final_completion().choices[0].message
        else:
            message = client.chat.completions.create(**kwargs).choices[0].message  # type: ignore[call-overload]
        messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = calc.calculate(json.loads(call.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    stack.check(rid)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_responses(stack: Stack, stream: bool) -> None:
    rid = stack.rollout()
    client = openai.OpenAI(base_url=f"{stack.base(rid)}/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", **FN}]
    items: list[Any] = [{"role": "user", "content": QUESTION}]
    for _ in range(4):
        kwargs = {"model": "gpt-5", "instructions": SYSTEM, "input": items, "tools": tools}
        if stream:
            with client.responses.stream(**kwargs, temperature=0) as s:  # type: ignore[arg-type]
                response = s.get_final_response()
        else:
            response = client.responses.create(**kwargs, temperature=0)  # type: ignore[arg-type]
        items += [o.model_dump(exclude_none=True) for o in response.output]
        calls = [o for o in response.output if o.type == "function_call"]
        if not calls:
            break
        for call in calls:
            result = calc.calculate(json.loads(call.arguments)["expression"])
            items.append(
                {"type": "function_call_output", "call_id": call.call_id, "output": result}
            )
    stack.check(rid)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages(stack: Stack, stream: bool) -> None:
    rid = stack.rollout()
    client = anthropic.Anthropic(base_url=stack.base(rid), api_key="x", max_retries=0)
    tools = [
        {"name": FN["name"], "description": FN["description"], "input_schema": FN["parameters"]}
    ]
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    for _ in range(4):
        kwargs = {
            "model": "claude-sonnet-4-6",
            "max_tokens": 64,
            "system": SYSTEM,
            "messages": messages,
            "tools": tools,
            "extra_body": {"temperature": 0},  # this SDK no longer offers the parameter
        }
        if stream:
            with client.messages.stream(**kwargs) as s:  # type: ignore[arg-type]
                reply = s.get_final_message()
        else:
            reply = client.messages.create(**kwargs)  # type: ignore[arg-type]
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            break
        results = [
            {
                "type": "tool_result",
                "tool_use_id": u.id,
                "content": calc.calculate(u.input["expression"]),
            }  # type: ignore[index]
            for u in uses
        ]
        messages.append({"role": "user", "content": results})
    stack.check(rid)


def test_openai_agents_with_a_function_tool(stack: Stack) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # its traces would go to a remote service

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return calc.calculate(expression)

    rid = stack.rollout()
    client = openai.AsyncOpenAI(base_url=f"{stack.base(rid)}/v1", api_key="x", max_retries=0)
    model = agents.OpenAIResponsesModel(model="gpt-5", openai_client=client)
    agent = agents.Agent(
        name="calculator",
        instructions=SYSTEM,
        tools=[calculator],
        model=model,
        model_settings=agents.ModelSettings(temperature=0),
    )
    result = agents.Runner.run_sync(agent, QUESTION, max_turns=4)
    assert isinstance(result.final_output, str)
    stack.check(rid)
