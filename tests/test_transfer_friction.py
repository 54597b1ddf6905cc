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
from tracerl.store import NotFound
from tracerl.store.sqlite import SqliteStore
from tracerl.traces import list_rollouts, resolve_rollout_id, show_rollout
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


def test_sft_help_prints_each_default_once() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tracerl.cli", "sft", "--help"], capture_output=True, text=True
    ).stdout
    text = " ".join(out.split())  # argparse wraps lines
    steps = re.findall(r"--steps int (.*?)--batch_size", text)[-1]
    lr = re.findall(r"--lr float (.*?)--stop_loss", text)[-1]
    holdout = re.findall(r"--holdout float (.*?)--eval_every int", text)[-1]
    assert re.findall(r"\(default: (\d+)\)", steps) == [str(SftConfig().steps)]
    assert [float(x) for x in re.findall(r"\(default: ([0-9.e-]+)\)", lr)] == [SftConfig().lr]
    for flag in (steps, lr, holdout):
        assert flag.count("(default:") == 1 and "null" not in flag
    assert "skill-then-habit" in out and "SftConfig's" not in out
    assert "tracerl models get" in out  # where a --base comes from


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


@pytest.mark.parametrize("width", [80, 120])
def test_traces_list_reads_at_terminal_widths_and_show_takes_its_prefix(
    tmp_path: Path, width: int
) -> None:
    store = SqliteStore(tmp_path / "t.db")
    store.add_tasks([Task(id=f"calc-train-{i:04d}", input={}) for i in range(3)])
    answer = "the capital of Zarnia is Velm, founded in 1412 by the river people"
    ids = [r.id for r in store.enqueue([f"calc-train-{i:04d}" for i in range(3)])]
    for rid in ids:
        store.claim("r", 1, 60.0)
        store.finish(rid, 1, RolloutStatus.succeeded, answer=answer, reward=0.0)
    console = Console(width=width, record=True)
    list_rollouts(store, console=console)
    text = console.export_text()
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines)
    row = lines[1].split()
    # task, status, attempt and reward keep their text at any width; the answer gives way.
    assert row[1:5] == ["calc-train-0000", "answered", "1", "0"]
    assert "succeeded" not in text
    shown = row[0]
    assert ids[0].startswith(shown) and len(shown) >= 12
    out = Console(width=width, record=True)
    show_rollout(store, shown, out)
    assert ids[0] in out.export_text()
    with pytest.raises(NotFound, match="'' starts 3 rollout ids"):
        resolve_rollout_id(store, "")
    with pytest.raises(NotFound, match="no rollout 'zz'"):
        resolve_rollout_id(store, "zz")


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
