"""The friction a new user met on a new task: demo files with extra keys, help without
numbers, file-relative TOML paths, truncated trace ids, and the generic habit degradation."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console

from tracerl.entrypoints.train import file_relative
from tracerl.evaluate import load_tasks
from tracerl.export.formats import read_training_file
from tracerl.models.recipe import corrupt, degrade
from tracerl.models.sft import Demo, SftConfig, load_demos
from tracerl.store.sqlite import SqliteStore
from tracerl.traces import list_rollouts
from tracerl.types import RolloutStatus, Task

DEMO = {
    "messages": [
        {"role": "system", "content": "Look it up."},
        {"role": "user", "content": "Capital of Zarnia?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "search", "arguments": "{\"q\": \"Zarnia\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Zarnia: capital Velm, pop 41200"},
        {"role": "assistant", "content": "Velm"},
    ],
    "tools": [],
}  # fmt: skip


def test_demo_lines_may_carry_extra_keys_and_bad_lines_are_named(tmp_path: Path) -> None:
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps({"id": "d1", "family": "lookup", **DEMO}) + "\n")
    assert load_demos(path)[0].messages[-1]["content"] == "Velm"
    path.write_text(json.dumps(DEMO) + "\n" + json.dumps({"messages": "oops"}) + "\n")
    with pytest.raises(ValueError, match=r"demos.jsonl:2: messages"):
        load_demos(path)


@pytest.mark.parametrize("read", [load_demos, load_tasks, read_training_file])
def test_every_jsonl_reader_names_the_line_that_is_not_an_object(
    tmp_path: Path, read: Callable[[Path], object]
) -> None:
    path = tmp_path / "file.jsonl"
    path.write_text(json.dumps(DEMO) + "\n\n" + '{"messages": [\n')
    with pytest.raises(ValueError, match=r"file.jsonl:3: not valid JSON"):
        read(path)
    path.write_text('["a list"]\n')
    with pytest.raises(ValueError, match=r"file.jsonl:1: each line must be a JSON object"):
        read(path)


def test_sft_help_prints_the_default_numbers() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tracerl.cli", "sft", "--help"], capture_output=True, text=True
    ).stdout
    text = " ".join(out.split())  # argparse wraps lines
    steps = re.search(r"Optimizer steps \(default: (\d+)", text)
    lr = re.search(r"Peak learning rate \(default: ([0-9.e-]+),", text)
    assert steps and int(steps.group(1)) == SftConfig().steps
    assert lr and float(lr.group(1)) == SftConfig().lr
    assert "skill-then-habit" in out and "SftConfig's" not in out


def test_toml_paths_are_read_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text("def run(task, **kw):\n    return ''\n")
    (tmp_path / "tasks.jsonl").write_text("{}\n")
    data = {"agent": "agent.py:run", "tasks": "tasks.jsonl", "model": "/abs/model",
            "reward": "mypkg.reward:fn", "roles": {"a": {"model": "nowhere"}}}  # fmt: skip
    out = file_relative(data, tmp_path)
    assert out["agent"] == f"{tmp_path}/agent.py:run" and out["tasks"] == f"{tmp_path}/tasks.jsonl"
    # Absolute paths, module specs and paths not beside the file keep their meaning.
    assert (out["model"], out["reward"], out["roles"]) == (
        "/abs/model",
        "mypkg.reward:fn",
        data["roles"],
    )


def test_traces_list_shows_whole_ids_and_long_answers(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "t.db")
    store.add_tasks([Task(id="t1", input={})])
    rid = store.enqueue(["t1"])[0].id
    store.claim("r", 1, 60.0)
    answer = "the capital of Zarnia is Velm, founded in 1412 by the river people"
    store.finish(rid, 1, RolloutStatus.succeeded, answer=answer, reward=0.0)
    console = Console(width=200, record=True)
    list_rollouts(store, console=console)
    text = console.export_text()
    assert rid in text and answer in text
    assert "answered" in text and "succeeded" not in text  # a lifecycle state, not a verdict


def test_corrupt_changes_one_character_of_its_kind() -> None:
    rng = random.Random(0)
    for text in ("4213", "Velm", '{"name": "Ada", "age": 41}'):
        bad = corrupt(text, rng)
        assert len(bad) == len(text) and sum(a != b for a, b in zip(text, bad, strict=True)) == 1


def test_degrade_skips_the_tools_and_guesses_a_wrong_answer() -> None:
    demo = Demo.model_validate(DEMO)
    bad = degrade(demo, random.Random(1))
    assert [m["role"] for m in bad.messages] == ["system", "user", "assistant"]
    assert "tool_calls" not in bad.messages[-1] and bad.messages[-1]["content"] != "Velm"
    assert len(str(bad.messages[-1]["content"])) == 4
