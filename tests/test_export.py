"""`tracerl export` and back: ADP and OpenAI lines from real calculator rollouts.

ADP carries the recorded ids, so export -> import gives identical ids and masks. OpenAI
lines carry text, re-rendered with the chat template on import: identical to the recorded
ids for conversations the gateway extended without a prefix break (see
tracerl/export/formats.py for when they cannot be).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tracerl.examples import example_file
from tracerl.export import export_rows, load_tools, read_rows
from tracerl.export.formats import (
    AdpTrajectory,
    ApiAction,
    MessageAction,
    TextObservation,
    adp_to_messages,
    conversation,
    read_training_file,
)
from tracerl.models.sft import Demo, EncodedDemo, encode_demo

from .test_sft_traces import record_calculator

pytestmark = pytest.mark.slow

TOOLS = f"{example_file('calculator', 'agent')}:TOOLS"


@pytest.fixture(scope="module")
def run_dir(calculator_skilled_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("run") / "traces.db"
    return record_calculator(calculator_skilled_dir, path, 10)


def test_adp_round_trip_gives_identical_ids(run_dir: Path, tmp_path: Path) -> None:
    rows = read_rows(run_dir, "")
    out = tmp_path / "adp.jsonl"
    assert export_rows(rows, "adp", out, load_tools(TOOLS)) == len(rows)
    back = read_training_file(out)
    assert all(isinstance(e, EncodedDemo) for e in back)
    for row, e in zip(rows, back, strict=True):
        assert isinstance(e, EncodedDemo)
        assert e.input_ids == row.row.input_ids
        assert e.loss_mask == [bool(m) for m in row.row.loss_mask]


def test_adp_trajectory_reads_as_actions_and_observations(run_dir: Path, tmp_path: Path) -> None:
    rows = read_rows(run_dir, "reward >= 1")
    export_rows(rows, "adp", tmp_path / "adp.jsonl", load_tools(TOOLS))
    lines = (tmp_path / "adp.jsonl").read_text().splitlines()
    multi = [(r, json.loads(t)) for r, t in zip(rows, lines, strict=True) if len(r.spans) >= 2]
    assert multi
    row, raw = multi[0]
    traj = AdpTrajectory.model_validate(raw)
    kinds = [type(s) for s in traj.content]
    assert kinds[0] is TextObservation and traj.content[0].source == "user"  # type: ignore[union-attr]
    assert ApiAction in kinds and kinds[-1] is MessageAction
    call = next(s for s in traj.content if isinstance(s, ApiAction))
    result = traj.content[traj.content.index(call) + 1]
    assert isinstance(result, TextObservation) and result.source == "environment"
    assert result.name == "calculator" and call.function == "calculator"
    assert raw["details"]["reward"] == row.rollout.reward and raw["details"]["tools"]
    # Without the ids extension, the steps still give back the recorded conversation.
    system = raw["details"]["system"]
    assert _plain(adp_to_messages(system, traj.content)) == _plain(conversation(row))
    del raw["details"]["tracerl_tokens"]
    (tmp_path / "text.jsonl").write_text(json.dumps(raw) + "\n")
    (demo,) = read_training_file(tmp_path / "text.jsonl")
    assert isinstance(demo, Demo) and demo.tools


def _plain(messages: list) -> list:
    """Messages with what a reader compares: role, text, calls (name, parsed arguments)."""
    out = []
    for m in messages:
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]), c["id"])
                 for c in m.get("tool_calls") or []]  # fmt: skip
        out.append((m["role"], m.get("content") or "", calls, m.get("tool_call_id")))
    return out


def test_openai_round_trip_re_renders_the_same_ids(
    run_dir: Path, calculator_skilled_dir: Path, tmp_path: Path
) -> None:
    rows = read_rows(run_dir, "")
    clean = [
        r for r in rows
        if all(s.prefix_break is None and s.finish_reason != "length" for s in r.spans)
    ]  # fmt: skip
    assert len(clean) >= len(rows) // 2
    out = tmp_path / "openai.jsonl"
    export_rows(clean, "openai", out, load_tools(TOOLS))
    demos = read_training_file(out)
    tokenizer = AutoTokenizer.from_pretrained(calculator_skilled_dir)
    for row, demo in zip(clean, demos, strict=True):
        assert isinstance(demo, Demo)
        encoded = encode_demo(tokenizer, demo)
        assert encoded.input_ids == row.row.input_ids
        assert encoded.loss_mask == [bool(m) for m in row.row.loss_mask]


def test_cli_export(run_dir: Path, tmp_path: Path) -> None:
    from tracerl.cli import main

    out = tmp_path / "x.jsonl"
    main(["export", "--store", str(run_dir / "traces.db"), "--format", "openai",
          "--filter", "reward >= 1", "--tools", TOOLS, "--out", str(out)])  # fmt: skip
    lines = [json.loads(t) for t in out.read_text().splitlines()]
    assert lines and all(line["reward"] >= 1 and line["tools"] for line in lines)
    with pytest.raises(SystemExit, match="unknown field"):
        main(["export", "--store", str(run_dir), "--filter", "size > 1", "--out", str(out)])
