"""Third-party agents, unchanged, against `tracerl serve --model DIR` through plain /v1.

The framework examples' agents (openai SDK, LangGraph, openai-agents; the planner/executor
pair), smolagents' ToolCallingAgent, the openai SDK's Responses API and Anthropic's Messages
API (streamed and not), and optionally the coding CLIs (Codex, Claude Code from
.npm-tools/), one after another under one API key: one session, each conversation a thread
of it. Every HTTP call goes through a counting proxy, so every status is seen, the CLIs'
too. Per agent: runs and successes (the example's reward), calls and their statuses,
exceptions raised in the client, calls recorded with token ids, threads and prefix breaks,
how tools were rendered.

A protocol error is a call answered with a 5xx, a call recorded without its ids, or an
exception the client raised on a response (a refused request is in protocol when its
status and JSON error are the API's own: 400 context_length_exceeded for a prompt beyond
the model's positions).

Usage: python bench/real_agents.py --model models/smollm2 [--tasks 2] [--only a,b] [--clis]
(`make smollm2` builds the model; about 10 minutes for 2 tasks per agent on a 2-core CPU.)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tracerl.examples import example_module
from tracerl.server import serve_in_thread
from tracerl.store.client import StoreClient
from tracerl.types import Span

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "one-key-for-every-agent"
QUESTION = "What is 37 + 48? Use the calculator."
SYSTEM = "Use the calculator, then answer with the number."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the counting proxy ---------------------------------------------------------------------


class Proxy:
    """Forwards every request to the gateway and notes each response's path and status."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.seen: list[tuple[str, int]] = []
        self._client = httpx.AsyncClient(base_url=upstream, timeout=600)
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=["GET", "POST"])])
        self.server = serve_in_thread(app)

    async def _forward(self, request: Request) -> Response:
        drop = {"host", "content-length", "connection"}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in drop}
        upstream = self._client.build_request(
            request.method, request.url.path, params=request.query_params,
            headers=headers, content=await request.body(),
        )  # fmt: skip
        reply = await self._client.send(upstream, stream=True)
        self.seen.append((request.url.path, reply.status_code))
        keep = {
            k: v for k, v in reply.headers.items() if k.lower() not in drop | {"transfer-encoding"}
        }
        return StreamingResponse(reply.aiter_raw(), reply.status_code, keep,
                                 background=None)  # fmt: skip

    @property
    def url(self) -> str:
        return self.server.url


# -- the agents -----------------------------------------------------------------------------

Agent = Callable[[dict, str], str]
"""(task, base URL of the proxy without /v1) -> the agent's answer."""


def _example(name: str, tasks_from: str | None = None) -> tuple[Agent, Any, Any]:
    agent = example_module(name, "agent")
    folder = tasks_from or name

    def run(task: dict, base: str) -> str:
        kwargs: dict[str, Any] = {"base_url": f"{base}/v1", "api_key": API_KEY}
        if name != "planner_executor":
            kwargs["model"] = "policy"
        return str(agent.run(task["input"], **kwargs))

    return run, example_module(folder, "tasks"), example_module(folder, "reward").reward


def _calc(expression: str) -> str:
    return str(example_module("calculator", "agent").calculate(expression))


def _smolagents(task: dict, base: str) -> str:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. 2+3.
        """
        return _calc(expression)

    model = OpenAIServerModel(model_id="policy", api_base=f"{base}/v1", api_key=API_KEY,
                              client_kwargs={"max_retries": 0}, max_tokens=48)  # fmt: skip
    agent = ToolCallingAgent(tools=[calculator], model=model, max_steps=3, verbosity_level=0)
    return str(agent.run(task["input"]["question"]))


def _openai_chat(stream: bool, force: bool = False) -> Agent:
    """The openai SDK's chat loop; `force`: the first call asks for a tool call
    (tool_choice "required"), so every run is at least two turns."""

    def run(task: dict, base: str) -> str:
        import openai

        calc = example_module("calculator", "agent")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
        messages: list[Any] = [{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": task["input"]["question"]}]  # fmt: skip
        for turn in range(3):
            kwargs = {"model": "gpt-5", "messages": messages, "tools": calc.TOOLS, "max_tokens": 48}
            if force and turn == 0:
                kwargs["tool_choice"] = "required"
            if stream:
                message = _streamed(client.chat.completions.create(**kwargs, stream=True))  # type: ignore[call-overload]
            else:
                reply = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
                message = reply.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            if not message.get("tool_calls"):
                return message.get("content") or ""
            for call in message["tool_calls"]:
                args = json.loads(call["function"]["arguments"] or "{}")
                result = _calc(str(args.get("expression", "")))
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return ""

    return run


def _streamed(chunks: Any) -> dict[str, Any]:
    """A streamed chat completion reassembled as its message (the SDK's stream helper
    refuses a reply cut by max_tokens when tools are given: a client may take it)."""
    content, calls = "", {}
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] = tc.id or entry["id"]
                entry["name"] += (tc.function and tc.function.name) or ""
                entry["arguments"] += (tc.function and tc.function.arguments) or ""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls.values()
        ]  # fmt: skip
    return message


def _responses(stream: bool) -> Agent:
    def run(task: dict, base: str) -> str:
        import openai

        fn = example_module("calculator", "agent").TOOLS[0]["function"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
        items: list[Any] = [{"role": "user", "content": task["input"]["question"]}]
        for _ in range(3):
            kwargs = {"model": "gpt-5", "instructions": SYSTEM, "input": items,
                      "tools": [{"type": "function", **fn}], "max_output_tokens": 48}  # fmt: skip
            if stream:
                # The last event holds the response: completed, or incomplete when cut by
                # max_output_tokens (the SDK's stream helper refuses the latter).
                ends = ("response.completed", "response.incomplete")
                events = client.responses.create(**kwargs, stream=True)  # type: ignore[call-overload]
                response = next(e.response for e in reversed(list(events)) if e.type in ends)
            else:
                response = client.responses.create(**kwargs)  # type: ignore[arg-type]
            items += [o.model_dump(exclude_none=True) for o in response.output]
            calls = [o for o in response.output if o.type == "function_call"]
            if not calls:
                return response.output_text
            for call in calls:
                result = _calc(str(json.loads(call.arguments or "{}").get("expression", "")))
                items.append({"type": "function_call_output", "call_id": call.call_id,
                              "output": result})  # fmt: skip
        return ""

    return run


def _anthropic(stream: bool) -> Agent:
    def run(task: dict, base: str) -> str:
        import anthropic

        fn = example_module("calculator", "agent").TOOLS[0]["function"]
        client = anthropic.Anthropic(base_url=base, api_key=API_KEY, max_retries=0)
        tools = [{"name": fn["name"], "description": fn["description"],
                  "input_schema": fn["parameters"]}]  # fmt: skip
        messages: list[Any] = [{"role": "user", "content": task["input"]["question"]}]
        for _ in range(3):
            kwargs = {"model": "claude-sonnet-4-6", "max_tokens": 48, "system": SYSTEM,
                      "messages": messages, "tools": tools}  # fmt: skip
            if stream:
                with client.messages.stream(**kwargs) as s:  # type: ignore[arg-type]
                    reply = s.get_final_message()
            else:
                reply = client.messages.create(**kwargs)  # type: ignore[arg-type]
            messages.append(
                {"role": "assistant", "content": [b.model_dump() for b in reply.content]}
            )
            uses = [b for b in reply.content if b.type == "tool_use"]
            if not uses:
                return "".join(b.text for b in reply.content if b.type == "text")
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id,
                 "content": _calc(str(u.input.get("expression", "")))}  # type: ignore[union-attr]
                for u in uses
            ]})  # fmt: skip
        return ""

    return run


def _agents() -> dict[str, tuple[Agent, Any, Any]]:
    calc_tasks = example_module("calculator", "tasks")
    calc_reward = example_module("calculator", "reward").reward
    agents = {
        name: _example(name, tasks_from)
        for name, tasks_from in [
            ("calculator", None), ("code_calculator", None), ("extract", None),
            ("lookup", None), ("shop", None), ("textgame", None),
            ("langgraph_calculator", "calculator"), ("openai_agents_calculator", "calculator"),
            ("planner_executor", None),
        ]
    }  # fmt: skip
    extra = {
        "smolagents": _smolagents,
        "openai-chat-stream": _openai_chat(stream=True),
        "openai-chat-forced": _openai_chat(stream=False, force=True),
        "openai-chat-forced-stream": _openai_chat(stream=True, force=True),
        "responses": _responses(stream=False),
        "responses-stream": _responses(stream=True),
        "anthropic": _anthropic(stream=False),
        "anthropic-stream": _anthropic(stream=True),
    }
    agents.update({name: (fn, calc_tasks, calc_reward) for name, fn in extra.items()})
    return agents


# -- the coding CLIs ------------------------------------------------------------------------

CLI_TASK = "Create hello.txt containing the word hello."


def _closed_env(home: Path, **extra: str) -> dict[str, str]:
    """Its own HOME, and a proxy that leads nowhere for anything not on loopback."""
    home.mkdir(parents=True, exist_ok=True)
    dead = "http://127.0.0.1:9"
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TERM") if k in os.environ}
    return {**keep, "HOME": str(home), "HTTPS_PROXY": dead, "HTTP_PROXY": dead,
            "ALL_PROXY": dead, "NO_PROXY": "127.0.0.1,localhost", **extra}  # fmt: skip


def _codex(base: str, work: Path) -> str:
    home = work / "codex-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        'model = "policy"\nmodel_provider = "tracerl"\n[model_providers.tracerl]\n'
        f'name = "tracerl"\nbase_url = "{base}/v1"\nwire_api = "responses"\n'
        'env_key = "TRACERL_CLI_KEY"\nrequest_max_retries = 0\nstream_max_retries = 0\n'
        "[analytics]\nenabled = false\n"
    )
    env = _closed_env(work / "home", CODEX_HOME=str(home), TRACERL_CLI_KEY=API_KEY)
    argv = [str(ROOT / ".npm-tools/node_modules/.bin/codex"), "exec", "--skip-git-repo-check",
            CLI_TASK]  # fmt: skip
    return _run_cli(argv, env, work / "codex-work")


def _claude(base: str, work: Path) -> str:
    env = _closed_env(
        work / "home", ANTHROPIC_BASE_URL=base, ANTHROPIC_API_KEY=API_KEY,
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1", DISABLE_ERROR_REPORTING="1", DISABLE_BUG_COMMAND="1",
    )  # fmt: skip
    argv = [str(ROOT / ".npm-tools/node_modules/.bin/claude"), "-p", CLI_TASK, "--max-turns", "3"]
    return _run_cli(argv, env, work / "claude-work")


REFUSALS = ("API Error: 5", 'ERROR: {"error"', "unexpected status 5")
"""What each CLI prints when the server broke protocol (a 5xx, an unreadable reply)."""


def _run_cli(argv: list[str], env: dict[str, str], cwd: Path) -> str:
    """Run a CLI; its last output (the task need not succeed: the model is small)."""
    cwd.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    output = (done.stdout + done.stderr)[-2000:]
    print(output, flush=True)
    broken = [r for r in REFUSALS if r in output]
    return f"ProtocolError: {broken}" if broken else "ok"


# -- running and counting -------------------------------------------------------------------


@contextlib.contextmanager
def served(model: str, store: Path, max_tokens: int) -> Iterator[str]:
    """`tracerl serve --model MODEL` as its own process, answering any model name."""
    port = _free_port()
    cmd = [sys.executable, "-m", "tracerl.cli", "serve", "--model", model, "--store", str(store),
           "--port", str(port), "--gateway.default_model", "policy",
           "--engine.default_max_tokens", str(max_tokens)]  # fmt: skip
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None:
                raise SystemExit("tracerl serve exited")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _spans(store: StoreClient) -> list[Span]:
    return [s for r in store.rollouts() for s in store.spans(r.id, r.attempt)]


PROTOCOL = ("APIResponseValidationError", "ValidationError", "JSONDecodeError", "ProtocolError")
"""Client exceptions that mean the server's reply broke the API's shape."""


def _measure(
    name: str, proxy: Proxy, store: StoreClient, runs: Callable[[], list[tuple[str, float | None]]]
) -> dict[str, Any]:
    """Run one agent's tasks; what its calls did."""
    seen, before = len(proxy.seen), {s.id for s in _spans(store)}
    started = time.perf_counter()
    outcomes = runs()
    wall = time.perf_counter() - started
    time.sleep(0.5)  # the last span's write
    mine = [s for s in _spans(store) if s.id not in before]
    calls = [status for path, status in proxy.seen[seen:] if path.endswith(("/completions",
             "/responses", "/messages"))]  # fmt: skip
    with_ids = [s for s in mine if s.prompt_ids and s.completion_ids
                and len(s.logprobs) == len(s.completion_ids)]  # fmt: skip
    errors = [o for o, _ in outcomes if o != "ok"]
    return {
        "agent": name,
        "runs": len(outcomes),
        "succeeded": sum((r or 0.0) >= 1.0 for _, r in outcomes),
        "calls": len(calls),
        "statuses": dict(Counter(calls)),
        "exceptions": errors,
        "recorded": len(mine),
        "with_ids": len(with_ids),
        "threads": len({s.thread_id for s in mine}),
        "prefix_breaks": [s.prefix_break for s in mine if s.prefix_break],
        "tool_rendering": dict(Counter(str(s.response.get("tool_rendering")) for s in mine)),
        "prompt_tokens_max": max((len(s.prompt_ids) for s in mine), default=0),
        "protocol_errors": sum(c >= 500 for c in calls) + len(mine) - len(with_ids)
        + sum(e.startswith(PROTOCOL) for e in errors),
        "wall_s": round(wall, 1),
    }  # fmt: skip


def _attempts(
    agent: Agent, tasks: list[dict], base: str, reward: Any
) -> list[tuple[str, float | None]]:
    return [_attempt(agent, task, base, reward) for task in tasks]


def _attempt(agent: Agent, task: dict, base: str, reward: Any) -> tuple[str, float | None]:
    try:
        answer = agent(task, base)
    except Exception as e:  # the client raised: noted, the next run goes on
        traceback.print_exc(limit=3)
        return f"{type(e).__name__}: {str(e)[:200]}", None
    return "ok", float(reward(task, answer))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2")
    p.add_argument("--tasks", type=int, default=2, help="tasks per agent")
    p.add_argument("--only", default="", help="comma-separated agent names")
    p.add_argument("--clis", action="store_true", help="also Codex and Claude Code")
    p.add_argument("--max-tokens", type=int, default=64, help="for calls that set none")
    p.add_argument("--out", default="runs/real-agents")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    agents = _agents()
    names = [n for n in args.only.split(",") if n] or list(agents)
    rows = []
    with served(args.model, out / "traces.db", args.max_tokens) as url:
        proxy = Proxy(url)
        store = StoreClient(f"{url}/store")
        for name in names:
            agent, tasks, reward = agents[name]
            picked = tasks.make_tasks(args.tasks, "eval", 1)
            runs = functools.partial(_attempts, agent, picked, proxy.url, reward)
            rows.append(_measure(name, proxy, store, runs))
            print(json.dumps(rows[-1]), flush=True)
        if args.clis:
            with tempfile.TemporaryDirectory() as tmp:
                for name, cli in (("codex", _codex), ("claude-code", _claude)):
                    done = lambda cli=cli: [(cli(proxy.url, Path(tmp)), None)]  # noqa: E731
                    rows.append(_measure(name, proxy, store, done))
                    print(json.dumps(rows[-1]), flush=True)
        proxy.server.stop()
    (out / "agents.json").write_text(json.dumps(rows, indent=2))
    _table(rows)


def _table(rows: list[dict[str, Any]]) -> None:
    print(f"{'agent':<26}{'ok/runs':>8}{'calls':>7}{'statuses':>22}{'ids':>9}{'threads':>8}"
          f"{'breaks':>7}{'proto':>6}{'max prompt':>11}")  # fmt: skip
    for r in rows:
        print(f"{r['agent']:<26}{r['succeeded']:>4}/{r['runs']:<3}{r['calls']:>7}"
              f"{json.dumps(r['statuses']):>22}{r['with_ids']:>4}/{r['recorded']:<4}"
              f"{r['threads']:>8}{len(r['prefix_breaks']):>7}{r['protocol_errors']:>6}"
              f"{r['prompt_tokens_max']:>11}")  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
