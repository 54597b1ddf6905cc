"""A calculator agent written with the openai-agents SDK: it knows nothing of tracerl.

An `Agent` with one function tool, run by `Runner` on the Chat Completions model of an
`AsyncOpenAI` client pointed at whatever base_url it is given. Point base_url at any
OpenAI-compatible server and it works the same.
"""

from __future__ import annotations

import ast
import asyncio
import operator

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

set_tracing_disabled(True)  # the SDK's traces would go to a remote service

SYSTEM_PROMPT = "Use the calculator, then answer with the number."
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


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return calculate(expression)


async def _solve(question: str, base_url: str, api_key: str, model: str) -> str:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(
        name="calculator",
        instructions=SYSTEM_PROMPT,
        tools=[calculator],
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=ModelSettings(max_tokens=48),
    )
    try:
        result = await Runner.run(agent, question, max_turns=MAX_TURNS)
    except MaxTurnsExceeded:
        return ""
    finally:
        await client.close()
    return str(result.final_output).strip()


def run(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    """Solve one task ({"question": ...}); returns the final answer text."""
    return asyncio.run(_solve(task["question"], base_url, api_key, model))
