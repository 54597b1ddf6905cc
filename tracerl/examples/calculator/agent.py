"""A calculator agent written against the public OpenAI client only.

It knows nothing of tracerl: it is given a base_url, an api_key and a model name, and runs a
plain tool-calling loop (model -> tool call -> calculator result -> model -> final answer).
Point base_url at any OpenAI-compatible server and it works the same. Only when the runner
asks for tool noise (a `tracerl_noise` key in the task) does it import tracerl, to perturb
its calculator's results (tracerl.noise).
"""

from __future__ import annotations

import ast
import functools
import json
import math
import operator
import os
import random
import sys
import time

import httpx
from openai import OpenAI

SYSTEM_PROMPT = "Use the calculator, then answer with the number."

TOOLS = [
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

MAX_TURNS = 4

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.USub: operator.neg,
}


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


def tool_latency() -> float:
    """Simulated tool latency in seconds: CALCULATOR_TOOL_LATENCY="MEDIAN_S,SIGMA" draws a
    log-normal sleep (a long tail, like a real API's); unset means none."""
    spec = os.environ.get("CALCULATOR_TOOL_LATENCY")
    if not spec:
        return 0.0
    median, sigma = (float(x) for x in spec.split(","))
    return random.lognormvariate(math.log(median), sigma)


@functools.cache
def _http() -> httpx.Client:
    # One connection pool for every client this process makes: building an HTTP client
    # (its TLS context) costs tens of milliseconds, more than a model call here.
    return httpx.Client(timeout=60.0, limits=httpx.Limits(max_connections=256))


def tools_for(task: dict) -> dict:
    """The agent's tools; with noise when the runner asked for it (tracerl.noise)."""
    tools = {"calculator": calculate}
    if "tracerl_noise" in task:  # imported only then: the agent runs without tracerl
        from tracerl import noise

        tools = noise.wrap(tools, task)
    return tools


def run(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    """Solve one task ({"question": ...}); returns the final answer text."""
    calculator = tools_for(task)["calculator"]
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=_http())
    messages: list = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
    ]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=48
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return (message.content or "").strip()
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            time.sleep(tool_latency())
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": calculator(str(expression))}
            )
    return ""


if __name__ == "__main__":
    # The external-command form: configuration from the environment, the task as JSON on
    # argv[1] (or stdin), the answer as the last line of stdout.
    raw = sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read()
    print(
        run(
            json.loads(raw),
            base_url=os.environ["OPENAI_BASE_URL"],
            api_key=os.environ.get("OPENAI_API_KEY", "none"),
            model=os.environ.get("OPENAI_MODEL", "policy"),
        )
    )
