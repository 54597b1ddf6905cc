"""The planner-executor example end to end through the runner and a two-role gateway.

Scripted engines play perfect planner and executor models, so the agent's real code runs
against the real gateway: spans carry their roles, each executor's calls name the planner
completion that asked (X-Tracerl-Parent), a planner may spawn a planner, bad parent ids are
refused with a JSON error, and `tracerl traces show` prints the calls as a tree.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import httpx
import openai
import pytest
from rich.console import Console
from transformers import AutoTokenizer

from tests.scripted import TurnEngine
from tracerl.agents import python_agent
from tracerl.demo import example_dir
from tracerl.evaluate import role_stats
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.runner import Runner, RunnerConfig
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store.sqlite import SqliteStore
from tracerl.types import RolloutStatus, Span, Task

EXAMPLE = example_dir("planner_executor")


def _load(name: str) -> ModuleType:
    """An example module by path, under a private name and leaving sys.path alone: the
    calculator example's agent.py and tasks.py are importable by those bare names here."""
    spec = importlib.util.spec_from_file_location(f"test_pe_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


agent, tasks, reward = _load("agent"), _load("tasks"), _load("reward")


def _call(name: str, key: str, value: str) -> str:
    return json.dumps({"name": name, "arguments": {key: value}}).join(
        ["<tool_call>", "</tool_call>"]
    )


class RoleEngine(TurnEngine):
    """A perfect planner or executor, read off the prompt; exact ids, fixed log-probs.

    With `delegate`, the planner asks a three-operation question's first two operations as
    one sub-question (which a planner sub-agent then splits again).
    """

    def __init__(self, tokenizer, role: str, delegate: bool = False) -> None:  # type: ignore[no-untyped-def]
        version = 0 if role == "planner" else 5
        super().__init__(tokenizer, max_context=2048, policy_version=version, logprob=-0.2)
        self.role, self.delegate = role, delegate

    def reply(self, turns: list[tuple[str, str]]) -> str:
        question = next(c for r, c in turns if r == "user")
        results = [c for r, c in turns if r == "tool"]
        if self.role == "executor":
            if results:
                return results[-1]
            return _call("calculator", "expression", question[len("What is ") : -1])
        parsed = tasks.steps(question)
        assert parsed is not None, question
        start, chain = parsed
        if self.delegate and len(chain) == 3:
            # One composite sub-question for the first two operations, then the last one.
            asks = [tasks.question_text(start, chain[:2], words=False)]
            asks.append(f"What is {{}}{chain[2][0]}{chain[2][1]}?")
        else:
            asks = [f"What is {{}}{op}{b}?" for op, b in chain]
            asks[0] = asks[0].format(start)
        if len(results) == len(asks):
            return results[-1]
        return _call("ask_executor", "question", asks[len(results)].format(*results[-1:]))


@dataclass
class Stack:
    server: BackgroundServer
    store: SqliteStore
    path: Path


def _stack(tiny_model_dir: Path, tmp_path: Path, delegate: bool) -> Iterator[Stack]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = SqliteStore(tmp_path / "traces.db")
    models = {
        role: ServedModel(role, RoleEngine(tokenizer, role, delegate), tokenizer)
        for role in ("planner", "executor")
    }
    server = serve_in_thread(create_app(Gateway(store, models)))
    yield Stack(server, store, tmp_path / "traces.db")
    server.stop()
    store.close()


@pytest.fixture
def stack(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    yield from _stack(tiny_model_dir, tmp_path, delegate=False)


@pytest.fixture
def delegating(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    yield from _stack(tiny_model_dir, tmp_path, delegate=True)


QUESTIONS = {
    "two": ("What is (23+45)*3?", 204),
    "words": ("Compute 17+5, then multiply by 4", 88),
    "three": ("What is ((2+3)*4)-5?", 15),
}


def _run(stack: Stack, names: list[str], max_depth: int = 0) -> dict[str, list[Span]]:
    """Run the example agent on the named questions; spans of each finished rollout."""
    stack.store.add_tasks(
        [Task(id=n, input={"question": q}, answer=a) for n, (q, a) in QUESTIONS.items()]
    )
    stack.store.enqueue(names)
    run = functools.partial(agent.run, max_depth=max_depth)
    with ThreadPoolExecutor(4) as threads:
        runner = Runner(
            stack.store,
            stack.server.url,
            python_agent(run, threads),
            reward.reward,
            RunnerConfig(concurrency=3),
            model="planner",
        )
        asyncio.run(runner.run(until_idle=True))
    out = {}
    for rollout in stack.store.rollouts():
        assert rollout.status == RolloutStatus.succeeded, rollout.error
        assert rollout.reward == 1.0, rollout.answer
        out[rollout.task_id] = stack.store.spans(rollout.id)
    return out


def _asked(span: Span) -> str:
    """The sub-question a planner span's reply asks."""
    message = span.response["message"]
    assert isinstance(message, dict)
    [call] = message["tool_calls"]  # type: ignore[misc]
    return json.loads(call["function"]["arguments"])["question"]  # type: ignore[index]


def test_executors_are_children_of_the_planner_call_that_asked(stack: Stack) -> None:
    runs = _run(stack, ["two", "words", "three"])
    for name, spans in runs.items():
        planners = [s for s in spans if s.role == "planner"]
        executors = [s for s in spans if s.role == "executor"]
        steps = len(tasks.steps(QUESTIONS[name][0])[1])
        # One planner call per sub-question plus the answer; two calls per executor.
        assert len(planners) == steps + 1 and len(executors) == 2 * steps
        assert all(p.parent_span_id is None for p in planners)
        by_id = {p.id: p for p in planners}
        for ex in executors:
            parent = by_id[ex.parent_span_id or ""]
            assert ex.messages[1]["content"] == _asked(parent)
        # The k-th planner call spawned the k-th executor, whose two calls both name it.
        parents = [ex.parent_span_id for ex in executors]
        assert parents == [p.id for p in planners[:steps] for _ in range(2)]
        # Each sub-agent is its own conversation: every later call extends its own prompt.
        assert all(s.prefix_break is None for s in spans)
        assert all(s.prefix_reused > 0 for s in executors[1::2])
        assert [s.policy_version for s in executors] == [5] * len(executors)
    counts = {
        name: len({s.parent_span_id for s in spans if s.role == "executor"})
        for name, spans in runs.items()
    }
    assert counts == {"two": 2, "words": 2, "three": 3}


def _tree(spans: list[Span]) -> list[tuple[int, str, int | None]]:
    """(seq, role, parent seq) of each span."""
    seq = {s.id: s.seq for s in spans}
    return [(s.seq, s.role, seq.get(s.parent_span_id or "")) for s in spans]


# The delegating planner on ((2+3)*4)-5: it asks "(2+3)*4" of a planner sub-agent, which
# asks 2+3 and 5*4 of executors and answers 20; then it asks 20-5 of an executor.
RECURSIVE_TREE = [
    (0, "planner", None),  # top: ask "What is (2+3)*4?"
    (1, "planner", 0),  # sub-planner: ask "What is 2+3?"
    (2, "executor", 1),
    (3, "executor", 1),
    (4, "planner", 0),  # sub-planner: ask "What is 5*4?"
    (5, "executor", 4),
    (6, "executor", 4),
    (7, "planner", 0),  # sub-planner answers 20
    (8, "planner", None),  # top: ask "What is 20-5?"
    (9, "executor", 8),
    (10, "executor", 8),
    (11, "planner", None),  # top answers 15
]


def test_a_planner_spawning_a_planner_nests_two_levels(delegating: Stack) -> None:
    spans = _run(delegating, ["three"], max_depth=1)["three"]
    assert _tree(spans) == RECURSIVE_TREE
    assert _asked(spans[0]) == "What is (2+3)*4?" and _asked(spans[8]) == "What is 20-5?"
    # The top planner's conversation survives its same-role child: token ids are reused.
    assert spans[8].prefix_break is None
    assert spans[8].prefix_reused == len(spans[0].prompt_ids) + len(spans[0].completion_ids)
    # The eval report's per-role view of this tree: the top planner and one planner
    # sub-agent; three executor sub-agents (under calls 1, 4 and 8).
    stats = role_stats(spans, rollouts=1)
    assert list(stats) == ["planner", "executor"]
    assert (stats["planner"].calls_per_rollout, stats["planner"].agents_per_rollout) == (6, 2)
    assert (stats["executor"].calls_per_rollout, stats["executor"].agents_per_rollout) == (6, 3)


def test_traces_show_prints_the_nested_tree(
    delegating: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tracerl.cli

    spans = _run(delegating, ["three"], max_depth=1)["three"]
    out = io.StringIO()
    monkeypatch.setattr(tracerl.cli, "console", Console(file=out, width=300))
    tracerl.cli.main(["traces", "show", spans[0].rollout_id, "--store", str(delegating.path)])
    text = out.getvalue()
    heads = [line for line in text.splitlines() if "call " in line and " · role " in line]
    assert len(heads) == len(RECURSIVE_TREE)
    # Rich indents each tree level by four columns under the rollout's root.
    depth = {None: 0}
    for seq, _, parent in RECURSIVE_TREE:
        depth[seq] = depth[parent] + 1
    for line, (seq, role, _) in zip(heads, RECURSIVE_TREE, strict=True):
        assert f"call {seq} · role {role} ·" in line
        assert line.index("call ") == 4 * depth[seq], line
    # Every conversation shows its own question once: the top planner's, the sub-planner's
    # and the three executors'; later calls show only what is new.
    assert text.count(agent.PLANNER_PROMPT) == 2 and text.count(agent.EXECUTOR_PROMPT) == 3
    assert text.count("user: What is (2+3)*4?") == 1
    assert text.count("user: What is ((2+3)*4)-5?") == 1
    assert "reward reward (final): 1" in text


@pytest.fixture
def rollout(stack: Stack) -> str:
    stack.store.add_tasks([Task(id="t", input={"question": "What is (23+45)*3?"}, answer=204)])
    stack.store.enqueue(["t"])
    return stack.store.claim("test", 1, 60.0)[0].id


MESSAGES = [
    {"role": "system", "content": agent.EXECUTOR_PROMPT},
    {"role": "user", "content": "What is 23+45?"},
]


def _client(stack: Stack, rollout_id: str) -> openai.OpenAI:
    base = f"{stack.server.url}/rollouts/{rollout_id}/v1"
    return openai.OpenAI(base_url=base, api_key="x", max_retries=0)


def test_completion_id_names_the_span_and_streams_carry_the_parent(
    stack: Stack, rollout: str
) -> None:
    client = _client(stack, rollout)
    first = client.chat.completions.create(model="executor", messages=MESSAGES, n=2)
    hexid = first.id.removeprefix("chatcmpl-")
    assert [s.id for s in stack.store.spans(rollout)] == [hexid, f"{hexid}-1"]
    stream = client.chat.completions.create(
        model="executor",
        messages=MESSAGES,
        stream=True,
        extra_headers={"X-Tracerl-Parent": first.id},
    )
    chunk_ids = {chunk.id for chunk in stream}
    # A parent may also be named by a span id (here the second choice's).
    client.completions.create(
        model="executor",
        prompt="<|user|>hi<|end|>",
        max_tokens=5,
        extra_headers={"X-Tracerl-Parent": f"{hexid}-1"},
    )
    spans = stack.store.spans(rollout)
    assert [s.parent_span_id for s in spans] == [None, None, hexid, f"{hexid}-1"]
    assert chunk_ids == {f"chatcmpl-{spans[2].id}"}


def test_header_attribution_carries_the_parent(stack: Stack, rollout: str) -> None:
    first = _client(stack, rollout).chat.completions.create(model="executor", messages=MESSAGES)
    client = openai.OpenAI(
        base_url=f"{stack.server.url}/v1",
        api_key="x",
        max_retries=0,
        default_headers={"X-Tracerl-Rollout": rollout, "X-Tracerl-Parent": first.id},
    )
    client.chat.completions.create(model="executor", messages=MESSAGES)
    assert stack.store.spans(rollout)[1].parent_span_id == first.id.removeprefix("chatcmpl-")


def test_unknown_parent_is_a_400_json_error(stack: Stack, rollout: str) -> None:
    url = f"{stack.server.url}/rollouts/{rollout}/v1/chat/completions"
    body = {"model": "executor", "messages": MESSAGES}
    resp = httpx.post(url, json=body, headers={"X-Tracerl-Parent": "chatcmpl-nope"})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "parent_not_found" and err["type"] == "invalid_request_error"
    assert "chatcmpl-nope" in err["message"] and rollout in err["message"]
    # A call of another rollout is unknown in this one, also through the openai client.
    stack.store.add_tasks([Task(id="other", input={"question": "?"})])
    stack.store.enqueue(["other"])
    other = stack.store.claim("test", 1, 60.0)[0].id
    theirs = _client(stack, other).chat.completions.create(model="executor", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        _client(stack, rollout).chat.completions.create(
            model="executor", messages=MESSAGES, extra_headers={"X-Tracerl-Parent": theirs.id}
        )
    assert stack.store.spans(rollout) == []  # nothing was sampled or recorded
    # Without a rollout the call is recorded under a session, where "x" is unknown too.
    plain = httpx.post(
        f"{stack.server.url}/v1/chat/completions", json=body, headers={"X-Tracerl-Parent": "x"}
    )
    assert plain.status_code == 400 and plain.json()["error"]["code"] == "parent_not_found"


@pytest.mark.slow
def test_build_and_eval_scripts_run_a_few_steps(tmp_path: Path) -> None:
    # Subprocesses: the scripts import the example's modules by their bare names.
    def script(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    models = tmp_path / "models"
    script(
        str(EXAMPLE / "build_models.py"),
        str(models),
        *("--demos", "32", "--executor-skill-steps", "2", "--planner-skill-steps", "2"),
        *("--habit-steps", "1", "--no-progress"),
    )
    built = json.loads((models / "build.json").read_text())
    assert set(built["final_loss"]) == {"executor-skill", "planner-skill", "planner", "executor"}
    for role in ("planner", "executor"):
        assert (models / role / "config.json").exists()
    out = script(str(EXAMPLE / "eval_local.py"), str(models), "--tasks", "3", "--concurrency", "3")
    assert "over 3 rollouts" in out
    stats = json.loads(out.strip().splitlines()[-1])
    assert set(stats["calls_per_rollout"]) == {"planner", "executor"}
    assert sum(stats["executor_subagents_per_rollout"].values()) == 3
    # The README's command-line route: expert.py demos, then `tracerl sft` stage by stage.
    tracerl = str(Path(sys.executable).with_name("tracerl"))
    demos = [tmp_path / "executor.jsonl", tmp_path / "planner-lazy.jsonl"]
    script(str(EXAMPLE / "expert.py"), "executor", "32", str(demos[0]), "--noise", "0")
    lazy = ("--noise", "0.35", "--mistakes", "echo,skip")
    script(str(EXAMPLE / "expert.py"), "planner", "32", str(demos[1]), *lazy)
    for line in demos[1].read_text().splitlines():
        assert json.loads(line)["messages"][1]["role"] == "user"
    skill, planner = tmp_path / "executor-skill", tmp_path / "planner"
    for args in (
        ("--demos", str(demos[0]), "--out", str(skill), "--steps", "2"),
        ("--demos", str(demos[1]), "--base", str(skill), "--out", str(planner), "--steps", "2"),
    ):
        done = subprocess.run([tracerl, "sft", *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    assert (planner / "config.json").exists() and (planner / "tokenizer.json").exists()
