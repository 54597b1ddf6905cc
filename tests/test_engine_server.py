"""Server engines without vLLM: replica routing, the transformers engine as a server
process (engine.kind "hf_server"), and a replica killed under load.

The routing rules are checked on ReplicaSet directly. The hf_server tests start real child
processes (python -m tracerl.engines.hf_server) serving the demo's skilled calculator model:
rollouts through the gateway must be token-faithful as in process, weight sync exact, calls
of one routing key must stay on one replica, and a replica killed with SIGKILL mid-batch
must cost no call, be restarted, and serve the current weights when it is back.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tracerl.engines.base import EngineUnavailable
from tracerl.engines.config import EngineConfig
from tracerl.engines.hf_server import HFServerEngine
from tracerl.engines.launch import LaunchedEngine, group_has_others
from tracerl.engines.replicas import ReplicaSet
from tracerl.engines.scoring import score_completion
from tracerl.examples import example_module
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.server import serve_in_thread
from tracerl.types import Generation, SamplingParams, Span, Task

# -- routing rules ---------------------------------------------------------------------


def test_a_key_sticks_to_its_replica_and_new_keys_go_to_the_least_loaded() -> None:
    replicas = ReplicaSet(["http://a", "http://b", "http://c"], version=0)
    first = replicas.pick("rollout-1/policy")
    assert first is not None and replicas.enter(first) == 0  # one call in flight there
    for _ in range(5):
        assert replicas.pick("rollout-1/policy") is first
    others = [replicas.pick(f"rollout-{i}/policy") for i in (2, 3)]
    assert others == replicas.replicas[1:]  # the idle ones, in turn
    replicas.leave(first)


def test_a_replica_out_of_service_gets_no_call_until_it_is_back() -> None:
    replicas = ReplicaSet(["http://a", "http://b"], version=0)
    a, b = replicas.replicas
    assert replicas.pick("k") is a
    assert replicas.mark_down(a) and not replicas.mark_down(a)  # recovered once
    assert replicas.enter(a) is None
    assert replicas.pick("k") is b  # the key moves to a replica in service, and stays
    replicas.mark_up(a, "http://a2", version=4)
    assert replicas.pick("k") is b
    assert replicas.pick("other", avoid=b) is a and a.url == "http://a2"
    assert replicas.enter(a) == 4
    replicas.mark_down(b)
    assert replicas.pick("x", avoid=a) is None


def test_an_unavailable_engine_is_a_retryable_503(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    class DownEngine:
        max_context, eos_token_ids, policy_version = 512, [0], 0

        async def generate(self, prompt_ids, params, *, routing_key=None):  # type: ignore[no-untyped-def]
            raise EngineUnavailable("no engine replica is in service; retry shortly")

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    served = ServedModel("policy", DownEngine(), tokenizer)  # type: ignore[arg-type]
    server = serve_in_thread(create_app(Gateway(None, {"policy": served})))
    try:
        body = {"model": "policy", "messages": [{"role": "user", "content": "1+1"}]}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    finally:
        server.stop()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_unavailable"


# -- the transformers engine as a server -------------------------------------------------


def test_a_grammar_travels_to_the_server_and_rescoring_reproduces_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """RemoteEngine sends a ConstrainedParams grammar as vLLM's `structured_outputs`; the
    transformers server samples under it and reports the masked log-probs."""
    from tracerl.engines.constrained import ConstrainedParams
    from tracerl.engines.hf import HFEngine
    from tracerl.engines.hf_server import create_app as server_app
    from tracerl.engines.remote import RemoteEngine
    from tracerl.engines.scoring import Constraint

    schema = {
        "type": "object",
        "properties": {"n": {"enum": [1, 22, 333]}},
        "required": ["n"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }
    grammar = "start: %json " + json.dumps(schema)
    local = HFEngine(tiny_model_dir)
    server = serve_in_thread(server_app(local))
    remote = RemoteEngine(
        [server.url], tokenizer=local.tokenizer, max_context=local.max_context,
        eos_token_ids=local.eos_token_ids, weights_dir=tmp_path,
    )  # fmt: skip
    prompt = local.tokenizer.encode("1+1=")
    try:
        params = ConstrainedParams(max_tokens=24, temperature=1.0, seed=0, grammar=grammar)
        g = asyncio.run(remote.generate(prompt, params))
        bad = ConstrainedParams(max_tokens=4, grammar="start: %json {")
        with pytest.raises(ValueError, match="invalid grammar"):
            asyncio.run(remote.generate(prompt, bad))
    finally:
        remote.close()
        server.stop()
        local.close()
    text = local.tokenizer.decode(g.completion_ids, skip_special_tokens=True)
    assert g.finish_reason == "stop" and text in {'{"n":1}', '{"n":22}', '{"n":333}'}
    constraint = Constraint(grammar=grammar, eos_token_ids=remote.grammar_eos_token_ids)
    rescored = score_completion(
        local.model, prompt, g.completion_ids, 1.0, constraint, local.tokenizer
    )
    assert rescored == pytest.approx(g.logprobs, abs=1e-5)
    assert g.logprobs[0] == pytest.approx(0.0, abs=1e-6)  # '{' is forced


def _cfg(tmp: Path, replicas: int) -> EngineConfig:
    return EngineConfig(kind="hf_server", replicas=replicas, log_dir=str(tmp / "logs"))


@pytest.fixture(scope="module")
def reference(calculator_skilled_dir: Path) -> PreTrainedModel:
    """The trainer's view of the served weights: the HF model in fp32."""
    return AutoModelForCausalLM.from_pretrained(calculator_skilled_dir, dtype=torch.float32).eval()


@pytest.fixture
def two_replicas(calculator_skilled_dir: Path, tmp_path: Path) -> Iterator[HFServerEngine]:
    engine = HFServerEngine(calculator_skilled_dir, _cfg(tmp_path, 2))
    try:
        yield engine
    finally:
        engine.close()
    assert all(s.process.poll() is not None for s in engine.servers), "a server outlived close"
    assert not any(group_has_others(s.process.pid) for s in engine.servers)


def _prompt(engine: HFServerEngine, question: str) -> list[int]:
    agent = example_module("calculator", "agent")
    SYSTEM_PROMPT, TOOLS = agent.SYSTEM_PROMPT, agent.TOOLS
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    ids = engine.tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def _admitted(engine: HFServerEngine) -> list[int]:
    return [int(httpx.get(f"{url}/health").json()["admitted"]) for url in engine.urls]


def _gap(model: PreTrainedModel, prompt: list[int], g: Generation | Span, t: float) -> float:
    """Largest |recorded - re-scored| log-prob of a completion."""
    rescored = score_completion(model, prompt, g.completion_ids, t)
    return max(abs(a - b) for a, b in zip(rescored, g.logprobs, strict=True))


def _noisy(model: PreTrainedModel, scale: float) -> PreTrainedModel:
    """A copy of `model` with noise on every weight (the tied head follows the embedding)."""
    generator = torch.Generator().manual_seed(0)
    state = {
        k: v + scale * torch.randn(v.shape, generator=generator)
        for k, v in model.state_dict().items()
    }
    copy = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    copy.load_state_dict(state)
    return copy


@pytest.mark.slow
def test_rollouts_through_hf_server_are_token_faithful(
    calculator_skilled_dir: Path, reference: PreTrainedModel, tmp_path: Path
) -> None:
    """Multi-turn calculator rollouts through the gateway, served by hf_server processes:
    re-scored with the trainer's fp32 weights they give the recorded log-probs, each later
    prompt extends the earlier call, and every call of a rollout went to one replica."""
    run = example_module("calculator", "agent").run
    reward = example_module("calculator", "reward").reward
    make_tasks = example_module("calculator", "tasks").make_tasks

    from tracerl.agents import python_agent
    from tracerl.evaluate import run_rollouts
    from tracerl.runner import RunnerConfig
    from tracerl.stack import start_stack

    tasks = [Task.model_validate(t) for t in make_tasks(48, "eval", 1)]
    stack = start_stack(calculator_skilled_dir, tmp_path / "traces.db", _cfg(tmp_path, 2))
    engine = stack.engine
    assert isinstance(engine, HFServerEngine)
    try:
        with ThreadPoolExecutor(16) as threads:
            rollouts = run_rollouts(
                stack.store, stack.url, python_agent(run, threads), reward, tasks,
                cfg=RunnerConfig(concurrency=16),
            )  # fmt: skip
        spans_by_rollout = [stack.store.spans(r.id) for r in rollouts]
        admitted = _admitted(engine)
    finally:
        stack.close()
    multi_turn = [spans for spans in spans_by_rollout if len(spans) >= 2]
    assert len(multi_turn) >= 36, f"only {len(multi_turn)} multi-turn rollouts"
    breaks = sum(
        after.prompt_ids[: len(before.prompt_ids) + len(before.completion_ids)]
        != before.prompt_ids + before.completion_ids
        or after.prefix_break is not None
        for spans in multi_turn
        for before, after in zip(spans, spans[1:], strict=False)
    )
    worst = max(
        _gap(reference, s.prompt_ids, s, s.temperature) for spans in spans_by_rollout for s in spans
    )
    calls = sum(len(spans) for spans in spans_by_rollout)
    print(f"{calls} calls, per replica {admitted}; max |logprob gap| {worst:.2e}")
    assert breaks == 0
    assert worst <= 1e-4  # fp32, batched vs one sequence: as tests/test_faithfulness.py
    assert min(admitted) >= calls // 4, "new rollouts should spread over both replicas"


@pytest.mark.slow
def test_weight_sync_through_hf_server_is_exact_and_versioned(
    two_replicas: HFServerEngine, reference: PreTrainedModel
) -> None:
    engine = two_replicas
    prompt = _prompt(engine, "What is 64-19?")
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    perturbed = _noisy(reference, 0.05)
    started = time.monotonic()
    engine.load_state_dict(perturbed.state_dict(), 1)
    print(f"hf_server weight sync (2 replicas) {time.monotonic() - started:.3f} s")

    async def both() -> list[Generation]:
        keys = ["a", "b", "c", "d"]  # new keys alternate between the idle replicas
        return list(
            await asyncio.gather(*(engine.generate(prompt, params, routing_key=k) for k in keys))
        )

    for g in asyncio.run(both()):
        assert (g.policy_version, engine.policy_version) == (1, 1)
        assert _gap(perturbed, prompt, g, 1.0) <= 1e-4
        assert _gap(reference, prompt, g, 1.0) > 1e-2, "the served weights did not change"


@pytest.mark.slow
def test_calls_of_one_key_stay_on_one_replica(two_replicas: HFServerEngine) -> None:
    engine = two_replicas
    prompt = _prompt(engine, "What is 2+2?")
    params = SamplingParams(max_tokens=4, temperature=0.0)

    async def calls(keys: list[str]) -> None:
        for key in keys:
            await engine.generate(prompt, params, routing_key=key)

    before = _admitted(engine)
    asyncio.run(calls(["r1/policy"] * 6))
    after = _admitted(engine)
    assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 6]
    asyncio.run(calls([f"r{i}/policy" for i in range(2, 8)]))
    spread = [a - b for a, b in zip(_admitted(engine), after, strict=True)]
    assert spread == [3, 3], "idle replicas take new keys in turn"


@pytest.mark.slow
def test_a_replica_killed_under_load_costs_no_call_and_comes_back_current(
    two_replicas: HFServerEngine, reference: PreTrainedModel
) -> None:
    """SIGKILL one replica while it serves calls: every call still answers (retried on the
    other), new weights published meanwhile reach only the live one, and the killed one is
    restarted and synced to them before it takes calls again."""
    engine = two_replicas
    prompt = _prompt(engine, "What is 12+30?")
    victim = engine.servers[0]

    async def wave(n: int, http: httpx.AsyncClient) -> list[Generation] | None:
        """24 calls; kill the victim once it runs one of them. None when they all ended
        before it was seen running one (a busy machine polls slowly): try another wave."""
        tasks = [
            asyncio.ensure_future(
                engine.generate(
                    prompt,
                    SamplingParams(max_tokens=64, temperature=1.0, seed=i),
                    routing_key=f"w{n}k{i}",
                )
            )
            for i in range(24)
        ]
        while (await http.get(f"{victim.url}/health")).json()["running"] == 0:
            if all(t.done() for t in tasks):
                return None
            await asyncio.sleep(0.002)
        os.kill(victim.process.pid, signal.SIGKILL)
        return list(await asyncio.gather(*tasks))

    async def load() -> list[Generation]:
        async with httpx.AsyncClient() as http:  # polls without blocking the calls' loop
            for n in range(10):
                if (gens := await wave(n, http)) is not None:
                    return gens
        pytest.fail("the victim replica was never seen running a call")

    gens = asyncio.run(load())
    assert len(gens) == 24 and all(g.completion_ids for g in gens)
    new = _noisy(reference, 0.05)
    engine.load_state_dict(new.state_dict(), 1)  # the victim is down: only replica 1 switches
    deadline = time.monotonic() + 120
    while engine.recoveries < 1:
        assert time.monotonic() < deadline, "the killed replica did not come back"
        time.sleep(0.2)
    assert engine.servers[0] is not victim and engine.servers[0].process.poll() is None
    assert [r.version for r in engine.replicas.replicas] == [1, 1]
    back, other = engine.generate_sync(0, prompt, 8), engine.generate_sync(1, prompt, 8)
    assert back.completion_ids == other.completion_ids
    assert back.logprobs == pytest.approx(other.logprobs, abs=1e-4)
    assert _gap(new, prompt, back, 1.0) <= 1e-4, "the restarted replica kept old weights"


@pytest.mark.slow
def test_a_single_dead_replica_is_unavailable_until_restarted(
    calculator_skilled_dir: Path, tmp_path: Path
) -> None:
    engine = HFServerEngine(calculator_skilled_dir, _cfg(tmp_path, 1))
    try:
        prompt = _prompt(engine, "What is 3*3?")
        os.kill(engine.servers[0].process.pid, signal.SIGKILL)
        while engine.servers[0].exited() is None:
            time.sleep(0.01)
        with pytest.raises(EngineUnavailable):
            asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=4)))
        deadline = time.monotonic() + 120
        while engine.recoveries < 1:
            assert time.monotonic() < deadline, "the replica did not come back"
            time.sleep(0.2)
        g = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=4)))
        assert len(g.completion_ids) >= 1
    finally:
        engine.close()


@pytest.mark.slow
def test_a_failed_connection_to_a_healthy_server_is_retried_not_restarted(
    calculator_skilled_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection that fails while its server is fine (the server closed an idle pooled
    connection as the call went out on it) costs a retry, not the replica: no recovery, the
    same server process, the call answered."""
    engine = HFServerEngine(calculator_skilled_dir, _cfg(tmp_path, 1))
    try:
        prompt = _prompt(engine, "What is 3*3?")
        pid = engine.servers[0].process.pid
        post, failures = httpx.AsyncClient.post, []

        async def fails_once(self: httpx.AsyncClient, url: str, **kw: object) -> httpx.Response:
            if not failures:
                failures.append(url)
                raise httpx.ReadError("")  # what a connection closed under a request raises
            return await post(self, url, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(httpx.AsyncClient, "post", fails_once)
        g = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=4)))
        assert failures and len(g.completion_ids) >= 1
        time.sleep(0.5)  # a recovery, had one started, would be restarting the server now
        assert engine.recoveries == 0 and all(r.up for r in engine.replicas.replicas)
        assert engine.servers[0].process.pid == pid and engine.servers[0].exited() is None
    finally:
        engine.close()


class _DiesWhileStarting(LaunchedEngine):
    """A server engine whose server exits before it answers /health (a replica killed
    while a run starts)."""

    name = "dies"

    def command(self, host: str, port: str) -> list[str]:
        return [sys.executable, "-c", "raise SystemExit(3)"]


def test_a_server_that_dies_while_starting_fails_the_engine_with_its_log(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start fails with the server's exit and log, and leaves no weights directory."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    with pytest.raises(RuntimeError, match="exited with code 3 while starting"):
        _DiesWhileStarting(tiny_model_dir, _cfg(tmp_path, 1))
    assert list(temp.iterdir()) == [], "the engine's weights directory outlived its failed start"


class _EngineDies(LaunchedEngine):
    """A server engine whose server (tests/dead_engine_server.py) answers as vLLM's does
    until POST /die, then as vLLM's API server over a dead engine core: calls 500, /health
    503, the process alive."""

    name = "engine-dies"

    def command(self, host: str, port: str) -> list[str]:
        return [sys.executable, str(Path(__file__).with_name("dead_engine_server.py")), host, port]


def _wait_recoveries(engine: LaunchedEngine, n: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.recoveries < n:
        assert time.monotonic() < deadline, f"the replica did not come back ({n})"
        time.sleep(0.1)


def test_a_call_to_a_dead_engine_is_an_outage_and_the_replica_restarts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A call answered 500 by a server whose /health fails (its engine died) takes the
    replica out of service and fails as an outage (EngineUnavailable: the gateway answers a
    retryable 503, the runner re-runs the attempt), not as the call's own error; the
    server is replaced and calls succeed again."""
    engine = _EngineDies(tiny_model_dir, _cfg(tmp_path, 1))
    try:
        dead = engine.servers[0]
        httpx.post(f"{dead.url}/die")
        with pytest.raises(EngineUnavailable):
            asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_tokens=4)))
        _wait_recoveries(engine, 1)
        assert engine.servers[0] is not dead and dead.exited() is not None
        g = asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_tokens=4)))
        assert g.completion_ids == engine.eos_token_ids[:1]
    finally:
        engine.close()


def test_a_live_server_over_a_dead_engine_is_restarted_without_a_call(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The watch asks every server's /health: one whose process lives on while /health
    answers 503 (vLLM's API server over a dead engine core) is replaced, with no call
    failing on it first."""
    engine = _EngineDies(tiny_model_dir, _cfg(tmp_path, 1))
    try:
        dead = engine.servers[0]
        httpx.post(f"{dead.url}/die")
        _wait_recoveries(engine, 1)
        assert engine.servers[0] is not dead and dead.exited() is not None
        g = asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_tokens=4)))
        assert g.completion_ids == engine.eos_token_ids[:1]
    finally:
        engine.close()
