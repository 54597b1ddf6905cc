"""A calculator agent written with LangGraph's prebuilt ReAct agent: it knows nothing of
tracerl.

`create_react_agent` with one calculator tool and a `ChatOpenAI` client pointed at whatever
base_url it is given: LangGraph builds the prompts, sends the tool schema, runs the tool
and loops until the model answers without a tool call. Point base_url at any
OpenAI-compatible server and it works the same.
"""

from __future__ import annotations

import ast
import functools
import operator
import warnings

import httpx
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent

# LangGraph 1 points at langchain.agents.create_agent; the prebuilt agent still works.
warnings.filterwarnings("ignore", message="create_react_agent has been moved")

SYSTEM_PROMPT = "Use the calculator, then answer with the number."

MAX_TURNS = 4
"""Model calls at most; LangGraph counts a model call and a tool run as two steps."""

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


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return calculate(expression)


@functools.cache
def _http() -> httpx.Client:
    # One connection pool for every rollout of this process: a new client per rollout costs
    # more than a model call here.
    return httpx.Client(timeout=60.0, limits=httpx.Limits(max_connections=256))


def run(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    """Solve one task ({"question": ...}); returns the final answer text."""
    llm = ChatOpenAI(
        model=model,
        base_url=base_url,
        api_key=api_key,  # type: ignore[arg-type]
        max_tokens=48,  # type: ignore[call-arg]
        max_retries=0,
        http_client=_http(),
    )
    agent = create_react_agent(llm, [calculator], prompt=SYSTEM_PROMPT)
    try:
        state = agent.invoke(
            {"messages": [("user", task["question"])]}, {"recursion_limit": 2 * MAX_TURNS}
        )
    except GraphRecursionError:  # still calling tools after MAX_TURNS model calls
        return ""
    return str(state["messages"][-1].content).strip()
