"""`tracerl sft --from-traces`: SFT on the recorded ids of real calculator rollouts.

The rows come from the RL step's own merge (spans_to_transitions), so what SFT trains on
must be exactly what the policy sampled: the batch's masked ids are the spans'
completion_ids, nothing re-tokenized. The filter language is parsed, never evaluated.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tracerl.agents import python_agent
from tracerl.evaluate import run_rollouts
from tracerl.export import parse_filter, read_rows, rows_as_examples
from tracerl.models.sft import SftConfig, collate, mean_loss, sft
from tracerl.runner import RunnerConfig
from tracerl.stack import start_stack
from tracerl.types import Task

pytestmark = pytest.mark.slow


def record_calculator(model_dir: Path, store_path: Path, n: int) -> Path:
    """Run the calculator agent on n tasks through the gateway; the run dir holding the store."""
    from tracerl.examples import example_module

    agent = example_module("calculator", "agent")
    reward = example_module("calculator", "reward")
    tasks = [
        Task.model_validate(t)
        for t in example_module("calculator", "tasks").make_tasks(n, "train", 5)
    ]
    stack = start_stack(model_dir, store_path)
    try:
        with ThreadPoolExecutor(8) as threads:
            run_rollouts(stack.store, stack.url, python_agent(agent.run, threads), reward.reward,
                         tasks, cfg=RunnerConfig(concurrency=8))  # fmt: skip
    finally:
        stack.close()
    return store_path.parent


@pytest.fixture(scope="module")
def run_dir(calculator_skilled_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_calculator(
        calculator_skilled_dir, tmp_path_factory.mktemp("run") / "traces.db", 12
    )


def test_trained_tokens_are_the_sampled_tokens(run_dir: Path) -> None:
    rows = read_rows(run_dir, "reward >= 1 and status == succeeded")
    assert len(rows) >= 6, "the skilled model should solve most tasks"
    assert all((r.rollout.reward or 0) >= 1 for r in rows)
    assert any(len(r.spans) >= 2 for r in rows), "multi-turn rows expected"
    max_len = SftConfig().max_len
    assert all(len(r.row.input_ids) <= max_len for r in rows)
    _, _, labels_BT = collate(rows_as_examples(rows), pad_id=0, max_len=max_len)
    for b, r in enumerate(rows):
        masked = labels_BT[b][labels_BT[b] != -100].tolist()
        assert masked == [t for s in r.spans for t in s.completion_ids]
        assert r.row.input_ids[: len(r.spans[-1].prompt_ids)] == r.spans[-1].prompt_ids


def test_sft_from_traces_lowers_the_loss_on_them(run_dir: Path, calculator_model_dir: Path,
                                                 tmp_path: Path) -> None:  # fmt: skip
    """The skilled model's successful traces, learned by the demo's lazy model (it mostly
    skips the tool they call). On the skilled model itself the loss is ~1e-3 already, and
    12 noisy steps once left it 4% higher."""
    examples = rows_as_examples(read_rows(run_dir, "reward >= 1"))
    before = mean_loss(calculator_model_dir, examples, 256)
    cfg = SftConfig(steps=12, batch_size=4, lr=1e-3, warmup=0, bf16=False, progress=False)
    result = sft(calculator_model_dir, examples, tmp_path / "rft", cfg)
    after = mean_loss(result.out_dir, examples, 256)
    print(f"loss on the traces: {before:.4f} -> {after:.4f}")
    assert after < 0.8 * before


def test_call_level_clauses_select_calls(run_dir: Path) -> None:
    everything = read_rows(run_dir, "")
    assert read_rows(run_dir, "role == executor") == []
    assert read_rows(run_dir, "version >= 1") == []  # every call was sampled by version 0
    assert len(read_rows(run_dir, "version == 0 and role == policy")) == len(everything)
    some = everything[0].task.id[:3]
    assert all(r.task.id.startswith(some) for r in read_rows(run_dir, f"task ^= {some}"))


def test_filter_is_parsed_not_evaluated() -> None:
    flt = parse_filter("reward >= 1, status == succeeded and task ^= 'calc-'")
    assert [c.field for c in flt.rollout] == ["reward", "status", "task"]
    assert flt.keeps_rollout({"reward": 1.0, "status": "succeeded", "task": "calc-3"})
    assert not flt.keeps_rollout({"reward": None, "status": "succeeded", "task": "calc-3"})
    for bad in ("__import__('os').system('x')", "reward >= one", "status > a", "size == 3"):
        with pytest.raises(ValueError, match="filter clause"):
            parse_filter(bad)


def test_cli_sft_from_traces(run_dir: Path, calculator_skilled_dir: Path, tmp_path: Path) -> None:
    from tracerl.cli import main

    out = tmp_path / "rft"
    main(["sft", "--from-traces", str(run_dir), "--filter", "reward >= 1",
          "--base", str(calculator_skilled_dir), "--out", str(out), "--steps", "2"])  # fmt: skip
    assert (out / "config.json").exists()
    with pytest.raises(SystemExit, match="exactly one"):
        main(["sft", "--out", str(out)])
