"""A remote teacher recorded as a student's token ids, then SFT from those traces.

The LangGraph and the openai-agents calculator agents run unchanged against the gateway
while a scripted teacher
(examples/langgraph_calculator/teacher.py, an OpenAI-compatible server) answers as a remote
role that names the student's tokenizer. Each call must be recorded in the framework's own
prompt format as the student's ids, later turns extending earlier ids, and `sft
--from-traces` must train on exactly the teacher's reply ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tracerl.agents import python_agent
from tracerl.evaluate import run_rollouts
from tracerl.examples import example_module
from tracerl.export import read_rows, rows_as_examples
from tracerl.gateway.remote import RemoteModel
from tracerl.models.sft import SftConfig, collate, sft
from tracerl.server import serve_in_thread
from tracerl.stack import start_multi_stack
from tracerl.types import Task

pytestmark = pytest.mark.slow

EXAMPLE = "langgraph_calculator"
"""Where the teacher, the tasks and the reward live."""
FRAMEWORKS = ["langgraph_calculator", "openai_agents_calculator"]


@pytest.fixture(scope="module")
def teacher_url() -> Iterator[str]:
    """The scripted teacher on a free loopback port; it calls the tool on about half the tasks."""
    app = example_module(EXAMPLE, "teacher").create_app(tool_rate=0.5, seed=0)
    server = serve_in_thread(app)
    yield f"{server.url}/v1"
    server.stop()


@pytest.fixture(scope="module", params=FRAMEWORKS)
def recorded(
    request: pytest.FixtureRequest,
    teacher_url: str,
    calculator_skilled_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """The store of 12 rollouts of one framework's agent answered by the teacher, recorded
    as the ids of the demo model's tokenizer (the student)."""
    store_path = tmp_path_factory.mktemp("distill") / "traces.db"
    remote = {"policy": RemoteModel("policy", teacher_url, "teacher", None,
                                    str(calculator_skilled_dir))}  # fmt: skip
    stack = start_multi_stack({}, {}, store_path, remote=remote)
    tasks = [
        Task.model_validate(t) for t in example_module(EXAMPLE, "tasks").make_tasks(12, "train", 3)
    ]
    agent = example_module(request.param, "agent").run
    try:
        with ThreadPoolExecutor(4) as threads:
            run_rollouts(stack.store, stack.url, python_agent(agent, threads),
                         example_module(EXAMPLE, "reward").reward, tasks)  # fmt: skip
    finally:
        stack.close()
    return store_path


def test_teacher_calls_are_recorded_as_student_ids(
    recorded: Path, calculator_skilled_dir: Path
) -> None:
    from tracerl.store import SqliteStore

    tokenizer = AutoTokenizer.from_pretrained(calculator_skilled_dir)
    store = SqliteStore(recorded)
    rollouts = store.rollouts()
    assert len(rollouts) == 12 and all(r.reward == 1.0 for r in rollouts)  # the teacher is right
    calls = [store.spans(r.id) for r in rollouts]
    store.close()
    assert {len(c) for c in calls} == {1, 2}, "answered directly, and after one tool call"
    for spans in calls:
        first = tokenizer.decode(spans[0].prompt_ids)
        # The framework's own prompt: its system prompt and tool schema, in the template.
        assert first.startswith("<|system|>Use the calculator, then answer with the number.")
        assert "Tools: calculator(expression)" in first
        for s in spans:
            assert s.policy_version == -1 and s.logprobs == [0.0] * len(s.completion_ids)
            assert s.completion_ids[-1] == tokenizer.convert_tokens_to_ids("<|end|>")
        if len(spans) == 2:
            call, answer = spans
            assert tokenizer.decode(call.completion_ids).startswith(
                '<tool_call>{"name": "calculator"'
            )
            # The second call extends the first call's ids: no re-tokenization.
            assert answer.prefix_break is None
            earlier = call.prompt_ids + call.completion_ids
            assert answer.prefix_reused == len(earlier)
            assert answer.prompt_ids[: len(earlier)] == earlier


def test_sft_trains_exactly_the_teacher_ids(recorded: Path, calculator_skilled_dir: Path,
                                            tmp_path: Path) -> None:  # fmt: skip
    rows = read_rows(recorded, "reward >= 1")
    assert len(rows) == 12, "one row per rollout: its calls merge into one sequence"
    examples = rows_as_examples(rows)
    _, _, labels_BT = collate(examples, pad_id=0, max_len=256)
    for b, r in enumerate(rows):
        masked = labels_BT[b][labels_BT[b] != -100].tolist()
        assert masked == [t for s in r.spans for t in s.completion_ids]
        assert r.row.input_ids == r.spans[-1].prompt_ids + r.spans[-1].completion_ids
    cfg = SftConfig(steps=2, batch_size=4, warmup=0, progress=False)
    result = sft(calculator_skilled_dir, examples, tmp_path / "student", cfg)
    assert result.steps == 2 and (tmp_path / "student" / "config.json").exists()


@pytest.mark.parametrize("example", FRAMEWORKS)
def test_the_agent_file_imports_no_tracerl(example: str) -> None:
    from tracerl.examples import example_dir

    source = (example_dir(example) / "agent.py").read_text()
    imports = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert imports and not any("tracerl" in line for line in imports)
