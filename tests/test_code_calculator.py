"""The code-calculator example end to end: a scripted engine plays a good coding model behind
the real gateway, the example agent runs each `python` tool call in the bubblewrap sandbox
and feeds the output back, and the reward scores the answers. Also: the expert's programs
print every kind of task's answer in the sandbox, and its demonstrations are ready for SFT."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.scripted import TurnEngine
from tracerl.agents import python_agent
from tracerl.demo import example_module
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.models.sft import Demo, SftConfig, encode_demo, sft
from tracerl.models.template import format_tool_call
from tracerl.runner import Runner, RunnerConfig
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store.sqlite import SqliteStore
from tracerl.tools import format_result, run_python
from tracerl.types import RolloutStatus, Task

pytestmark = pytest.mark.sandbox  # the agent's python tool runs in bubblewrap

agent = example_module("code_calculator", "agent")
tasks = example_module("code_calculator", "tasks")
reward = example_module("code_calculator", "reward")
expert = example_module("code_calculator", "expert")

PROBES = {
    "Where does the code run?": (
        "import os, socket\nprint(os.getcwd(), socket.gethostname(), os.path.exists('/work'))"
    ),
    "Spin.": "while True:\n    pass",
    "Reverse the string 'abc'.": "print('abc')",  # forgets to reverse
}
"""Questions the engine answers with a program of its own instead of the expert's."""


class CodeEngine(TurnEngine):
    """A good coding model read off the prompt: the expert's program as a tool call, then
    the tool's output copied as the answer. Exact ids, fixed log-probs."""

    def __init__(self, tokenizer) -> None:  # type: ignore[no-untyped-def]
        super().__init__(tokenizer, max_context=4096, policy_version=2, logprob=-0.3)

    def reply(self, turns: list[tuple[str, str]]) -> str:
        if turns[-1][0] == "tool":
            return turns[-1][1]
        question = next(c for r, c in turns if r == "user")
        code = PROBES.get(question) or expert.program(question)
        return format_tool_call("python", {"code": code})


@dataclass
class Stack:
    server: BackgroundServer
    store: SqliteStore
    tokenizer: PreTrainedTokenizerBase


@pytest.fixture
def stack(tiny_model_dir: Path) -> Iterator[Stack]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = SqliteStore(":memory:")
    gateway = Gateway(store, {"policy": ServedModel("policy", CodeEngine(tokenizer), tokenizer)})
    server = serve_in_thread(create_app(gateway))
    yield Stack(server, store, tokenizer)
    server.stop()
    store.close()


def _one_of_each_kind() -> list[dict]:
    """The first eval task of every kind (told apart by the expert's question patterns)."""
    chosen: dict[int, dict] = {}
    for task in tasks.make_tasks(200, "eval", 1):
        question = task["input"]["question"]
        kind = next(i for i, (p, _) in enumerate(expert.PROGRAMS) if re.fullmatch(p, question))
        chosen.setdefault(kind, task)
    assert len(chosen) == len(tasks.KINDS) == len(expert.PROGRAMS)
    return list(chosen.values())


def _run_all(stack: Stack, task_list: list[Task]) -> None:
    stack.store.add_tasks(task_list)
    stack.store.enqueue([t.id for t in task_list])
    with ThreadPoolExecutor(4) as threads:
        runner = Runner(
            stack.store,
            stack.server.url,
            python_agent(agent.run, threads),
            reward.reward,
            RunnerConfig(concurrency=4),
        )
        asyncio.run(runner.run(until_idle=True))


def test_expert_programs_print_every_kinds_answer_in_the_sandbox() -> None:
    for task in _one_of_each_kind() + tasks.make_tasks(7, "train", 0):
        code = expert.program(task["input"]["question"])
        assert code is not None
        assert format_result(run_python(code, agent.SANDBOX)) == task["answer"], code


def test_agent_runs_tool_calls_in_the_sandbox_and_is_rewarded(stack: Stack) -> None:
    chosen = _one_of_each_kind()
    _run_all(stack, [Task(id=t["id"], input=t["input"], answer=t["answer"]) for t in chosen])
    answers = {t["id"]: t["answer"] for t in chosen}
    rollouts = stack.store.rollouts()
    assert len(rollouts) == len(chosen)
    for rollout in rollouts:
        assert rollout.status == RolloutStatus.succeeded, rollout.error
        assert rollout.answer == answers[rollout.task_id] and rollout.reward == 1.0
        call, answer = stack.store.spans(rollout.id)
        assert call.policy_version == 2 and answer.prefix_break is None
        # The second call's prompt holds the sandbox's output as the tool turn.
        prompt = stack.tokenizer.decode(answer.prompt_ids, skip_special_tokens=False)
        assert prompt.endswith(f"<|tool|>{answers[rollout.task_id]}<|end|><|assistant|>")


def test_wrong_programs_get_no_reward_and_limits_reach_the_model(stack: Stack) -> None:
    ids = ["where", "spin", "unreversed"]
    answers = ["/scratch sandbox False", "", "cba"]
    probes = [
        Task(id=i, input={"question": q}, answer=a)
        for i, q, a in zip(ids, PROBES, answers, strict=True)
    ]
    _run_all(stack, probes)
    got = {r.task_id: r for r in stack.store.rollouts()}
    # The program ran in the sandbox: its scratch dir, its hostname, no project files.
    assert got["where"].answer == "/scratch sandbox False" and got["where"].reward == 1.0
    # CPU time runs out first, unless the machine is so loaded that the wall clock does.
    assert re.fullmatch(r"\[stopped: (cpu|wall)_time limit\]", got["spin"].answer or "")
    assert got["spin"].reward == 0.0
    assert got["unreversed"].answer == "abc" and got["unreversed"].reward == 0.0


def test_reward_matches_the_printed_answer() -> None:
    task = {"answer": "[3, 7, 42]"}
    assert reward.reward(task, "[3, 7, 42]") == 1.0
    assert reward.reward(task, "The sorted list:\n`[3, 7, 42]`.") == 1.0
    assert reward.reward(task, "[3, 7, 41]") == 0.0
    assert reward.reward(task, "") == 0.0
    assert reward.reward({"answer": "olleh"}, "'olleh'") == 1.0


def test_demonstrations_warm_start_a_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    demos = [Demo(**d) for d in expert.demonstrations(16, noise=0.5, retry=0.5)]
    contents = [str(m.get("content")) for d in demos for m in d.messages if m["role"] == "tool"]
    assert any("NameError: name 'pritn' is not defined" in c for c in contents)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for demo in demos:
        encoded = encode_demo(tokenizer, demo)
        assert any(encoded.loss_mask) and not all(encoded.loss_mask)
    cfg = SftConfig(steps=3, batch_size=4, progress=False)
    result = sft(tiny_model_dir, demos, tmp_path / "model", cfg)
    assert result.steps == 3 and (tmp_path / "model" / "config.json").exists()
