"""`tracerl assets`: put, list, show and diff versions; compare two on tasks and optimize
one, through a served model, all recorded in the store; a person's mistakes are one-line
messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

import tracerl.cli
from tracerl.store import SqliteStore

ROOT = Path(__file__).resolve().parents[1]
AGENT = f"{ROOT}/tests/agents/asset_agent.py"
HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "matplotlib", "openai")


def cli(*args: str, monkeypatch: pytest.MonkeyPatch) -> str:
    console = Console(record=True, width=200)
    monkeypatch.setattr(tracerl.cli, "console", console)
    tracerl.cli.main(list(args))
    return console.export_text()


@pytest.mark.parametrize("args", [["assets", "--help"], ["assets", "compare", "--help"]])
def test_assets_help_imports_nothing_heavy(args: list[str]) -> None:
    code = (
        "import sys, tracerl.cli\n"
        "try:\n    tracerl.cli.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(' '.join(sorted(sys.modules)), file=sys.stderr)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True
    )
    assert "usage: tracerl assets" in out.stdout
    assert not [m for m in out.stderr.split() if m.split(".")[0] in HEAVY]


def test_put_list_show_and_diff(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = str(tmp_path / "s" / "traces.db")
    (tmp_path / "v1.txt").write_text("Answer with twice n.\nBe brief.\n")
    (tmp_path / "v2.txt").write_text("Answer with twice n.\nShow only the number.\n")
    out = cli("assets", "put", "rules", str(tmp_path / "v1.txt"), "--note", "first", "--store", store,
              monkeypatch=monkeypatch)  # fmt: skip
    assert "rules@1 stored (now current)" in out
    cli(
        "assets",
        "put",
        "rules",
        str(tmp_path / "v2.txt"),
        "--store",
        store,
        monkeypatch=monkeypatch,
    )
    listed = cli("assets", "list", "--store", store, monkeypatch=monkeypatch)
    assert "rules" in listed and "v2" in listed and "Answer with twice n." in listed
    shown = cli("assets", "show", "rules@1", "--store", store, monkeypatch=monkeypatch)
    assert "rules@1" in shown and "first" in shown and "Be brief." in shown and "v1, v2" in shown
    diff = cli("assets", "diff", "rules@v1", "rules", "--store", store, monkeypatch=monkeypatch)
    assert "-Be brief." in diff and "+Show only the number." in diff and "+++ rules@2" in diff


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["assets", "show", "nope"], "no asset 'nope'"),
        (["assets", "show", "rules@x"], "the version after @ must be a number"),
        (["assets", "show", "rules@9"], "has no version 9"),
        (["assets", "put", "bad/name", "FILE"], "expected NAME"),
        (["assets", "put", "rules@2", "FILE"], "put takes a NAME"),
        (["assets", "put", "rules", "missing.txt"], "cannot read missing.txt"),
        (["assets", "list", "--store", "nowhere/traces.db"], "no store at nowhere/traces.db"),
    ],
)
def test_mistakes_are_one_line_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("text")
    (tmp_path / "runs" / "assets").mkdir(parents=True)
    SqliteStore(tmp_path / "runs" / "assets" / "traces.db").put_asset("rules", "x")
    with pytest.raises(SystemExit) as e:
        cli(*args, monkeypatch=monkeypatch)
    assert message in str(e.value)


def _tasks(tmp_path: Path, n: int) -> str:
    path = tmp_path / "tasks.jsonl"
    rows = [
        {"id": f"t{i}", "input": {"n": i}, "split": "train" if i % 2 else "eval"} for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_compare_runs_both_arms_on_a_served_model(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = str(tmp_path / "traces.db")
    SqliteStore(store).put_asset("rules", "Answer with twice n.")
    out = cli(
        "assets", "compare", "rules@0", "rules", "--tasks", _tasks(tmp_path, 4), "--agent",
        f"{AGENT}:run", "--reward", f"{AGENT}:reward", "--model", str(tiny_model_dir),
        "--store", store, "--repeats", "2", monkeypatch=monkeypatch,
    )  # fmt: skip
    s = SqliteStore(store)
    (c,) = s.comparisons("rules")
    assert (c.a, c.b, len(c.pairs)) == (0, 1, 8)
    assert "rules@0 vs rules@1 over 8 paired rollouts" in out and c.id in out
    with_asset = s.spans(c.pairs[0].rollout_b)[0]
    assert (
        with_asset.assets == {"rules": 1}
        and with_asset.prompt_ids
        and with_asset.policy_version >= 0
    )
    assert with_asset.messages[0] == {"role": "system", "content": "Answer with twice n."}
    assert s.spans(c.pairs[0].rollout_a)[0].assets == {}
    s.close()


def test_optimize_with_the_served_policy_as_proposer(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = str(tmp_path / "traces.db")
    SqliteStore(store).put_asset("rules", "Answer with twice n.")
    out = cli(
        "assets", "optimize", "rules", "--tasks", _tasks(tmp_path, 6), "--agent", f"{AGENT}:run",
        "--reward", f"{AGENT}:reward", "--model", str(tiny_model_dir), "--store", store,
        "--optimize.rounds", "1", "--optimize.candidates", "2", "--optimize.cases", "1",
        monkeypatch=monkeypatch,
    )  # fmt: skip
    s = SqliteStore(store)
    (opt,) = s.optimizations("rules")
    assert opt.status in ("accepted", "rejected") and opt.proposer == "llm:policy"
    assert len(opt.rounds) == 1 and opt.id in out
    # The proposer's calls went through the gateway: token ids, the asset withheld.
    (proposer,) = [r for r in s.rollouts() if r.task_id.startswith("proposer/")]
    assert proposer.assets == {"rules": 0} and proposer.status.value == "succeeded"
    spans = s.spans(proposer.id)
    assert len(spans) == 2 and all(sp.prompt_ids and sp.assets == {} for sp in spans)
    assert spans[0].messages[1]["content"] == opt.rounds[0].proposer_prompt
    assert "Failed attempt" in opt.rounds[0].proposer_prompt
    s.close()
