"""bench/vs_trl.py: its shared reward and prompt rendering (fast), and a tiny end-to-end run
of both trainers (slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from transformers import AutoTokenizer

from tracerl.gateway.chat import ToolSpec, parse_reply
from tracerl.gateway.tito import PromptBuilder
from tracerl.models.template import format_tool_call

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "vs_trl.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_vs_trl", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reward_exact_and_partial() -> None:
    bench = _bench()
    task = {"input": {"question": "What is 37+48?"}}
    assert bench.reward(task, "37+48") == 1.0
    assert bench.reward(task, " 37 + 48 ") == 1.0
    assert bench.reward(task, "48+37") == 0.0  # same value, not the question's arithmetic
    assert bench.reward(task, "37-48") == 0.0
    assert bench.reward(task, "37-48", partial=True) == pytest.approx(2 / 3)
    assert bench.reward(task, "1*2", partial=True) == 0.0
    assert bench.reward(task, "", partial=True) == 0.0


def test_trl_side_reads_a_completion_as_the_gateway_does(tiny_model_dir: Path) -> None:
    """TRL's reward decodes ids like the gateway and finds the same call expression."""
    bench = _bench()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = format_tool_call("calculator", {"expression": "37+48"}) + tokenizer.eos_token
    ids = tokenizer.encode(text, add_special_tokens=False)
    reply = parse_reply(bench.gateway_text(tokenizer, ids), tools_given=True)
    assert bench.call_expression(reply.tool_calls) == "37+48"
    assert bench.call_expression([]) == ""


def test_trl_prompt_ids_equal_the_gateway_prompt_ids(tiny_model_dir: Path) -> None:
    """The pre-rendered text TRL tokenizes gives exactly the ids the gateway would send."""
    bench = _bench()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    messages = bench.prompt_messages("What is 37+48?")
    text = tokenizer.apply_chat_template(
        messages, tools=bench.TOOLS, add_generation_prompt=True, tokenize=False
    )
    trl_ids = tokenizer(text=[text])["input_ids"][0]  # what GRPOTrainer does with text prompts
    tools = [ToolSpec.model_validate(t).model_dump(exclude_none=True) for t in bench.TOOLS]
    gateway_ids = PromptBuilder(tokenizer).build(messages, tools, None).ids
    assert trl_ids == gateway_ids


@pytest.mark.slow
def test_bench_runs_both_trainers_and_prints_the_json_line(calculator_model_dir: Path) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    cmd = [
        sys.executable,
        str(BENCH),
        "--model",
        str(calculator_model_dir),
        "--steps",
        "2",
        "--tasks-per-step",
        "2",
        "--group-size",
        "4",
        "--max-tokens",
        "32",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("step_time_ratio", "reward_tracerl", "reward_trl", "tracerl_step_s", "trl_step_s"):
        assert key in result
    assert result["steps"] == 2
    assert result["rollouts_per_step"] == 8
    assert result["step_time_ratio"] > 0 and result["cpu_time_ratio"] > 0
    assert result["tracerl_step_s"] > 0 and result["trl_step_s"] > 0
    for key in ("reward_tracerl", "reward_trl", "start_reward_tracerl", "start_reward_trl"):
        assert 0.0 <= result[key] <= 1.0
    # The async run, generating in a server process of its own, ran too.
    assert result["engine_kind"] == "hf_server"
    assert 0.0 <= result["reward_tracerl_async"] <= 1.0
    for key in ("time_to_target_ratio", "tracerl_async_time_to_target_s", "trl_time_to_target_s"):
        assert key in result
