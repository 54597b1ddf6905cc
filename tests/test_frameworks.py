"""Agent frameworks, unchanged, against the gateway serving the long-context model through
plain /v1 (no rollout: each run is a session): LangGraph's create_react_agent and
smolagents' ToolCallingAgent. Every call must be answered in protocol (HTTP 200, nothing the
framework refuses) and recorded with its token ids; multi-turn sessions reuse earlier ids."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest

from tracerl.stack import LocalStack

from .longctx import (  # noqa: F401
    all_spans,
    check_recorded,
    long_model_dir,
    long_stack,
    summary,
    worst_rescore,
)

pytestmark = pytest.mark.slow


def _http(statuses: list[int]) -> httpx.Client:
    """An httpx client that notes every model call's status."""

    def note(response: httpx.Response) -> None:
        statuses.append(response.status_code)

    return httpx.Client(event_hooks={"response": [note]}, timeout=120)


def test_langgraph_react_agent(long_stack: LocalStack, long_model_dir: Path) -> None:  # noqa: F811
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.errors import GraphRecursionError
    from langgraph.prebuilt import create_react_agent

    @tool
    def read_file(path: str) -> str:
        """Read a file of the workspace."""
        return "def main():\n    return 0\n"

    statuses: list[int] = []
    llm = ChatOpenAI(
        model="policy",
        base_url=f"{long_stack.url}/v1",
        api_key="x",  # type: ignore[arg-type]
        max_tokens=48,
        max_retries=0,
        default_headers={"X-Tracerl-Session": "langgraph"},
        http_client=_http(statuses),
    )
    agent = create_react_agent(llm, [read_file], checkpointer=InMemorySaver())
    thread = {"configurable": {"thread_id": "t1"}, "recursion_limit": 8}
    for question in ("Read src/app.py and summarise it.", "Now read tests/test_app.py."):
        # A tiny model may call tools until the limit: that is not a protocol error.
        with contextlib.suppress(GraphRecursionError):
            agent.invoke({"messages": [("user", question)]}, thread)
    spans = all_spans(long_stack)
    print(summary("langgraph", spans))
    assert statuses and set(statuses) == {200}
    assert len(spans) == len(statuses) >= 2
    assert len(long_stack.store.rollouts()) == 1  # one session
    check_recorded(spans)
    assert sum(s.prefix_reused > 0 for s in spans) >= 1  # later turns extend earlier ids
    assert worst_rescore(long_model_dir, spans) <= 1e-4


def test_smolagents_tool_calling_agent(long_stack: LocalStack, long_model_dir: Path) -> None:  # noqa: F811
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def read_file(path: str) -> str:
        """Read a file of the workspace.

        Args:
            path: The file's path.
        """
        return "def main():\n    return 0\n"

    statuses: list[int] = []
    model = OpenAIServerModel(
        model_id="policy",
        api_base=f"{long_stack.url}/v1",
        api_key="x",
        client_kwargs={
            "default_headers": {"X-Tracerl-Session": "smolagents"},
            "http_client": _http(statuses),
            "max_retries": 0,
        },
        max_tokens=48,
    )
    agent = ToolCallingAgent(tools=[read_file], model=model, max_steps=3)
    agent.run("Read src/app.py and summarise it.")
    spans = all_spans(long_stack)
    print(summary("smolagents", spans))
    assert statuses and set(statuses) == {200}
    assert len(spans) == len(statuses) >= 2
    check_recorded(spans)
    assert worst_rescore(long_model_dir, spans) <= 1e-4
