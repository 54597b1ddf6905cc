"""A code-writing agent written against the public OpenAI client, with one tool: Python.

It is given a base_url, an api_key and a model name and runs a plain tool-calling loop: the
model writes a program as a `python` tool call, the program runs in tracerl's bubblewrap
sandbox (no network, no files outside a scratch directory, a few seconds of CPU), what it
printed goes back to the model as the tool message, and the model answers. The only tracerl
import is the sandbox that executes the tool call; the model may be served by any
OpenAI-compatible server.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import httpx
from openai import OpenAI

from tracerl.tools import PYTHON_TOOL, SandboxConfig, execute_tool_call

SYSTEM_PROMPT = "Write Python that prints the answer, run it, then reply with what it printed."

TOOLS = [PYTHON_TOOL]

MAX_TURNS = 4

SANDBOX = SandboxConfig(cpu_s=2, memory_mb=256, max_processes=16, wall_s=5.0)


@functools.cache
def _http() -> httpx.Client:
    # One connection pool for every client this process makes: building an HTTP client
    # (its TLS context) costs tens of milliseconds, more than a model call here.
    return httpx.Client(timeout=60.0, limits=httpx.Limits(max_connections=256))


def run(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    """Solve one task ({"question": ...}); returns the final answer text."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=_http())
    messages: list = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
    ]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=128
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return (message.content or "").strip()
        messages += [execute_tool_call(call, SANDBOX) for call in message.tool_calls]
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
