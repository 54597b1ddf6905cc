"""The trainer benches run on small settings, and what they measure holds.

bench/merge.py: merged multi-turn rows and one-row-per-span rows of the same 4-call
calculator rollouts give the same loss and gradients while the merged form forwards ~3x
fewer tokens. bench/mfu.py: the FLOP accounting matches a hand count. bench/prefix_tree.py
--recorded: rows from real smolagents rollouts train the same with and without the shared
prefix, forwarding it once.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from .longctx import long_model_dir  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str) -> ModuleType:
    """Import bench/<name>.py (a script folder, not a package) under a private name."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_merge_bench_same_loss_and_gradients_fewer_tokens() -> None:
    merge = _bench("merge")
    # One thread: with two, another busy process on the shared machine can stall every op.
    cfg = merge.MergeConfig(
        rollouts=8, group_size=4, reps=1, hidden_size=64, num_layers=2, threads=1
    )
    threads = torch.get_num_threads()
    try:
        report = merge.run(cfg)
    finally:
        torch.set_num_threads(threads)
    assert report.spans_per_rollout == 4
    assert report.merged_rows == 8 and report.per_span_rows == 32
    assert report.token_ratio > 2.5
    assert report.max_rel_loss_diff < 1e-5
    assert report.max_rel_grad_diff < 1e-5
    assert report.max_abs_logp_diff < 1e-5


def test_merge_bench_prompts_extend_previous_calls(tmp_path: Path) -> None:
    merge = _bench("merge")
    cfg = merge.MergeConfig(rollouts=2, group_size=2, hidden_size=32, num_layers=1)
    _, batch = merge.build_model_and_traces(cfg, tmp_path / "model")
    for spans in batch.spans:
        assert [s.seq for s in spans] == [0, 1, 2, 3]
        for prev, span in zip(spans, spans[1:], strict=False):
            head = prev.prompt_ids + prev.completion_ids
            assert span.prompt_ids[: len(head)] == head
            assert span.prefix_reused == len(head)


def test_mfu_flop_count_matches_hand_count(tiny_model_dir: Path) -> None:
    mfu = _bench("mfu")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    c = model.config
    d, f, layers, vocab = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    n_mm = layers * (4 * d * d + 3 * d * f) + vocab * d  # q,k,v,o + gate,up,down + head
    assert mfu.matmul_params(model) == n_mm
    assert mfu.step_flops(model, [10, 3]) == pytest.approx(
        6 * n_mm * 13 + 6 * layers * d * (10 * 11 + 3 * 4)
    )
    rows = mfu.calculator_rows(random.Random(0), 5, mfu.MfuConfig(), vocab)
    assert all(100 <= len(r.input_ids) <= 300 and r.loss_mask[0] == 0 for r in rows)


@pytest.mark.slow
def test_gpu_bench_serves_and_trains_on_the_cpu_path(
    calculator_model_dir: Path, tmp_path: Path
) -> None:
    # bench/gpu.py runs the same code per device; on the CPU it must serve faithfully and
    # train one step whose weights the following evaluation is served with.
    gpu = _bench("gpu")
    served = gpu.serve(str(calculator_model_dir), "cpu", 8, tmp_path)
    assert served["logprob_max_diff"] < 1e-4 and served["completion_tokens"] > 0
    trained = gpu.train_on(str(calculator_model_dir), "cpu", 1, 8, tmp_path)
    assert trained["span_versions"] == [0, 1]
    assert trained["step_s"] > 0 and trained["train_tok_per_s"] > 0


def test_noise_bench_eval_sees_the_tool_noise(calculator_skilled_dir: Path, tmp_path: Path) -> None:
    # bench/noise.py evaluates each model as `tracerl eval` does, with and without noise:
    # a model that calls the calculator on nearly every task loses held-out success when
    # every tool call is perturbed, and keeps it when none is.
    noise = _bench("noise")
    from tracerl.demo import write_calculator_tasks

    tasks = write_calculator_tasks(tmp_path / "tasks.jsonl", 1, 32)
    clean = noise.evaluate_one("clean", calculator_skilled_dir, tasks, tmp_path, 0.0, 0.0)
    noisy = noise.evaluate_one("noisy", calculator_skilled_dir, tasks, tmp_path, 1.0, 0.0)
    assert clean >= 0.7
    assert noisy <= clean - 0.3


@pytest.mark.slow
def test_prefix_bench_recorded_rollouts_share_the_framework_prompt(
    long_model_dir: Path,  # noqa: F811
) -> None:
    # smolagents' ToolCallingAgent, unchanged, through the gateway: every row of a group
    # opens with its system prompt and tool descriptions (over 1,000 tokens), which the tree
    # forwards once, and the loss and gradients stay those of one row per rollout.
    prefix = _bench("prefix_tree")
    cfg = prefix.PrefixConfig(
        recorded=True, groups=1, group_size=2, max_tokens=32, max_steps=1, reps=1, threads=1
    )
    threads = torch.get_num_threads()
    try:
        report = prefix.run(cfg)
    finally:
        torch.set_num_threads(threads)
    assert report.mode == "recorded" and report.framework.startswith("smolagents")
    assert report.rollouts == 2 and report.rows >= 2
    assert report.prefix_tokens > 1000
    assert report.tokens_on < report.tokens_off
    assert report.max_rel_grad_diff < 1e-4 and report.max_abs_logp_diff < 1e-4


@pytest.mark.slow
def test_assets_bench_runs_end_to_end_on_a_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    """bench/assets.py's stages on the tiny model (its numbers mean nothing there): the
    last line is the JSON report, and the runs carried and withheld the asset as told."""
    import json
    import os
    import subprocess

    args = [
        sys.executable, str(ROOT / "bench" / "assets.py"), "--model", str(tiny_model_dir),
        "--lr", "3e-4", "--steps", "2", "--train_tasks", "8", "--eval_tasks", "8",
        "--rounds", "1", "--candidates", "2", "--tasks_per_step", "2", "--group_size", "2",
        "--concurrency", "4", "--runs", str(tmp_path / "runs"), "--proposer", "llm",
        "--engine", "hf",
    ]  # fmt: skip
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    keys = {"success_none", "success_seed", "success_optimized", "repairs", "regressions",
            "p_value", "rounds", "proposer", "success_internalized_zero_shot",
            "success_rl_no_curriculum"}  # fmt: skip
    assert keys <= set(report) and report["proposer"] == "llm:policy" and report["rounds"] == 1
    metrics = (tmp_path / "runs" / "internalized" / "metrics.jsonl").read_text()
    assert '"assets/carried": 1.0' in metrics and '"assets/carried": 0.0' in metrics
    prompt = json.loads((tmp_path / "runs" / "prompt.json").read_text())
    assert prompt["success_seed"] == report["success_seed"]
