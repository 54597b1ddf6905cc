"""A planner-executor agent written against the public OpenAI client only.

A planner model reads a multi-step question and asks one sub-question at a time with the
`ask_executor` tool, seeing each answer before the next; then it answers with the number.
Each `ask_executor` call runs an executor sub-agent: a calculator loop on another model
(model -> calculator call -> result -> model -> answer). The executor's requests carry the
header X-Tracerl-Parent: the id of the planner completion that asked, so a server that
records traces can nest the executor's calls under the planner's; any other
OpenAI-compatible server ignores it. With max_depth > 0, a sub-question that still holds
several operations goes to a planner sub-agent instead, which plans it the same way.
"""

from __future__ import annotations

import ast
import functools
import json
import operator
import os
import re
import sys
from typing import Any

import httpx
from openai import OpenAI

PLANNER_PROMPT = "Ask the executor one step at a time, then answer with the number."
EXECUTOR_PROMPT = "Use the calculator, then answer with the number."

PLANNER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ask_executor",
            "description": "Ask the executor one arithmetic question; returns its answer.",
            "parameters": {
                "type": "object",
                "properties": {"question": {"type": "string"}},
                "required": ["question"],
            },
        },
    }
]

EXECUTOR_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]

PARENT_HEADER = "X-Tracerl-Parent"
PLANNER_TURNS = 5  # up to three sub-questions, the answer, one spare
EXECUTOR_TURNS = 3

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.USub: operator.neg,
}
_OPERATOR = re.compile(r"\d\)*\s*[-+*]")  # an operator after a number, not a minus sign


def calculate(expression: str) -> str:
    """Evaluate +, -, * over integers without eval(); errors come back as text."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("unsupported expression")

    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError):
        return "error"


def operations(question: str) -> int:
    """How many binary operations a question holds ("What is (2+3)*4?" -> 2)."""
    return len(_OPERATOR.findall(question)) + question.count(", then ")


@functools.cache
def _http() -> httpx.Client:
    # One connection pool for every client and sub-agent of this process: building an HTTP
    # client (its TLS context) costs tens of milliseconds, more than a model call here.
    return httpx.Client(timeout=60.0, limits=httpx.Limits(max_connections=256))


def _argument(call: Any, name: str) -> str:
    """One string argument of a tool call ('' when the arguments are not valid JSON)."""
    try:
        return str(json.loads(call.function.arguments).get(name, ""))
    except (json.JSONDecodeError, AttributeError):
        return ""


def execute(client: OpenAI, question: str, *, model: str, parent: str | None) -> str:
    """The executor sub-agent: a calculator loop on one sub-question; returns its answer."""
    headers = {PARENT_HEADER: parent} if parent else None
    messages: list = [
        {"role": "system", "content": EXECUTOR_PROMPT},
        {"role": "user", "content": question},
    ]
    for _ in range(EXECUTOR_TURNS):
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=EXECUTOR_TOOLS,
            max_tokens=48,
            extra_headers=headers,
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return (message.content or "").strip()
        for call in message.tool_calls:
            result = calculate(_argument(call, "expression"))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def plan(
    client: OpenAI,
    question: str,
    *,
    model: str,
    executor_model: str,
    parent: str | None = None,
    depth: int = 0,
) -> str:
    """A planner (sub-)agent: asks sub-questions one by one, then answers the question.

    A sub-question with several operations goes to a planner sub-agent while `depth` > 0,
    to an executor otherwise; either is told that this planner's completion spawned it.
    """
    headers = {PARENT_HEADER: parent} if parent else None
    messages: list = [
        {"role": "system", "content": PLANNER_PROMPT},
        {"role": "user", "content": question},
    ]
    for _ in range(PLANNER_TURNS):
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=PLANNER_TOOLS,
            max_tokens=64,
            extra_headers=headers,
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return (message.content or "").strip()
        for call in message.tool_calls:
            sub = _argument(call, "question")
            if depth > 0 and operations(sub) > 1:
                answer = plan(
                    client,
                    sub,
                    model=model,
                    executor_model=executor_model,
                    parent=reply.id,
                    depth=depth - 1,
                )
            else:
                answer = execute(client, sub, model=executor_model, parent=reply.id)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
    return ""


def run(
    task: dict,
    *,
    base_url: str,
    api_key: str,
    model: str = "planner",
    executor_model: str = "executor",
    max_depth: int = 0,
) -> str:
    """Solve one task ({"question": ...}); `model` plans, `executor_model` computes."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=_http())
    return plan(
        client, task["question"], model=model, executor_model=executor_model, depth=max_depth
    )


if __name__ == "__main__":
    # The external-command form: configuration from the environment, the task as JSON on
    # argv[1] (or stdin), the answer as the last line of stdout.
    raw = sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read()
    print(
        run(
            json.loads(raw),
            base_url=os.environ["OPENAI_BASE_URL"],
            api_key=os.environ.get("OPENAI_API_KEY", "none"),
            model=os.environ.get("OPENAI_MODEL", "planner"),
            executor_model=os.environ.get("EXECUTOR_MODEL", "executor"),
            max_depth=int(os.environ.get("PLANNER_MAX_DEPTH", "0")),
        )
    )
