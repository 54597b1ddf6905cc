"""The three engines on one workload: in-process transformers, the transformers server, vLLM.

Each engine serves the same head-size-64 calculator model (vLLM's CPU attention cannot run
the demo's head size 48) behind the gateway, and the calculator agent runs `--batch`
rollouts at once through it (the plain openai client, two to four calls each). Measured:

- `<engine>_tok_s`: sampled tokens per second of wall time over the batch, end to end
  (agents, gateway, tokenizing, span writes, engine).
- `<engine>_sync_s`: wall time of `load_state_dict` (publishing new weights) — vLLM and
  the transformers server; `hf_sync_s` is the server's, `hf_inproc_sync_s` the in-process one.
- `gateway_overhead_ms`: p50 over interleaved pairs of (latency of a token-id completion
  through the gateway) - (the same request by RemoteEngine straight to vLLM). The gateway
  call names no rollout, so it is recorded under its session, as any plain /v1 call is.
- `forwarder_overhead_ms`: the same, interleaved with it, for a bare forwarder on the same
  HTTP stack (parse JSON, await the same engine client, answer JSON): the cost of any Python
  gateway's extra HTTP hop, which the gateway's own checking and recording add to.
  `--only-overhead` measures just this, on vLLM (after two warm-up rollouts).
- `max_logprob_diff`: largest |recorded - fp32 re-scored| log-prob over every span of every
  engine.

The last line printed is JSON. Needs the vLLM environment (--vllm-python, default
.venv-vllm/bin/python; TRACERL_VLLM_PYTHON also works); --skip-vllm measures the others.

    .venv/bin/python bench/engines.py --batch 128
    .venv/bin/python bench/engines.py --only-overhead --pairs 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tracerl import ensure_passive_omp

ensure_passive_omp()

import httpx  # noqa: E402
import torch  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedModel  # noqa: E402

from tracerl.agents import python_agent  # noqa: E402
from tracerl.demo import cache_dir, calculator_demos  # noqa: E402
from tracerl.engines.base import Engine  # noqa: E402
from tracerl.engines.config import EngineConfig  # noqa: E402
from tracerl.engines.scoring import score_completion  # noqa: E402
from tracerl.evaluate import run_rollouts  # noqa: E402
from tracerl.examples import example_module  # noqa: E402
from tracerl.runner import RunnerConfig  # noqa: E402
from tracerl.server import serving  # noqa: E402
from tracerl.stack import LocalStack, start_stack  # noqa: E402
from tracerl.types import SamplingParams, Span, Task  # noqa: E402


def h64_model() -> Path:
    """The calculator model with 3 heads of 64 (tests/test_engine_vllm.py builds the same,
    into the same cache directory)."""
    from tracerl.models.sft import SftConfig, sft
    from tracerl.models.template import render_chat
    from tracerl.models.tiny import TinyModelConfig, build_tiny_model

    models = cache_dir() / "models"
    out = models / "calculator-tiny-h64-skill400-seed0"
    if (out / "config.json").exists():
        return out
    demos = calculator_demos(4000, seed=1000)
    base = models / "calculator-tiny-h64-base-seed0"
    if not (base / "config.json").exists():
        build_tiny_model(
            base, [render_chat(d.messages, d.tools) for d in demos], TinyModelConfig(num_heads=3)
        )
    sft(base, demos, out, SftConfig(steps=400))
    return out


def rollouts(stack: LocalStack, tasks: list[Task], concurrency: int) -> list[list[Span]]:
    """Run the calculator agent once per task through the stack; each rollout's spans."""
    agent = example_module("calculator", "agent").run
    reward = example_module("calculator", "reward").reward
    with ThreadPoolExecutor(concurrency) as threads:
        done = run_rollouts(
            stack.store, stack.url, python_agent(agent, threads), reward, tasks,
            cfg=RunnerConfig(concurrency=concurrency), desc=f"{len(tasks)} rollouts",
        )  # fmt: skip
    return [stack.store.spans(r.id) for r in done]


def throughput(stack: LocalStack, tasks: list[Task], batch: int) -> tuple[float, list[Span]]:
    """Sampled tokens per second over `batch` concurrent rollouts (after a warm-up)."""
    rollouts(stack, tasks[:8], 8)
    started = time.perf_counter()
    spans = [s for spans in rollouts(stack, tasks[8 : 8 + batch], batch) for s in spans]
    wall = time.perf_counter() - started
    return sum(len(s.completion_ids) for s in spans) / wall, spans


def sync_s(stack: LocalStack, reference: PreTrainedModel, reps: int = 3) -> float:
    """Median wall time of publishing new weights (fresh tensors each time)."""
    times = []
    for version in range(1, reps + 1):
        state = {k: v + 1e-3 * version for k, v in reference.state_dict().items()}
        started = time.perf_counter()
        stack.engine.load_state_dict(state, version)
        times.append(time.perf_counter() - started)
    stack.engine.load_state_dict(reference.state_dict(), reps + 1)  # back to the real model
    return statistics.median(times)


def forwarder(engine: Engine) -> FastAPI:
    """The least any Python HTTP gateway does: parse the JSON body, await the same engine
    client, answer JSON, on the same server (uvicorn, FastAPI) — nothing checked or recorded.
    Its overhead is the floor the gateway's own is read against."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def complete(request: Request) -> dict[str, Any]:
        body = await request.json()
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"])
        gen = await engine.generate(body["prompt"], params)
        return {"choices": [{"index": 0, "token_ids": gen.completion_ids}]}

    return app


def gateway_overhead_ms(stack: LocalStack, prompt: list[int], pairs: int) -> dict[str, float]:
    """p50 of (through the gateway) - (straight to the engine) for one greedy request, and the
    same for a bare forwarder (`forwarder`), interleaved: {"gateway": ms, "forwarder": ms}."""
    engine = stack.engine
    params = SamplingParams(max_tokens=4, temperature=0.0)
    body = {"model": "policy", "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    loop = asyncio.new_event_loop()  # one loop, so the engine keeps one connection pool
    diffs: dict[str, list[float]] = {"gateway": [], "forwarder": []}
    with serving(forwarder(engine)) as bare, httpx.Client(timeout=60) as client:
        urls = {"gateway": stack.url, "forwarder": bare}
        for i in range(pairs + 10):
            for name, url in urls.items():
                t0 = time.perf_counter()
                loop.run_until_complete(engine.generate(prompt, params))
                t1 = time.perf_counter()
                response = client.post(f"{url}/v1/completions", json=body)
                t2 = time.perf_counter()
                assert response.status_code == 200, response.text
                if i >= 10:  # the first calls warm connections up
                    diffs[name].append((t2 - t1) - (t1 - t0))
    loop.close()
    return {name: 1000 * statistics.median(d) for name, d in diffs.items()}


def max_gap(reference: PreTrainedModel, spans: list[Span]) -> float:
    """Largest |recorded - re-scored| log-prob over `spans`."""
    worst = 0.0
    for s in spans:
        rescored = score_completion(reference, s.prompt_ids, s.completion_ids, s.temperature)
        worst = max([worst, *(abs(a - b) for a, b in zip(rescored, s.logprobs, strict=True))])
    return worst


def measure(model: Path, cfg: EngineConfig, args: Any) -> dict[str, float]:
    """One engine's numbers: tok_s, spans, max_logprob_diff, sync_s (vLLM: overhead_ms)."""
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    make_tasks = example_module("calculator", "tasks").make_tasks
    tasks = [Task.model_validate(t) for t in make_tasks(args.batch + 8, "eval", 1)]
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        stack = start_stack(model, Path(tmp) / "traces.db", cfg)
        print(f"{cfg.kind}: ready in {time.perf_counter() - started:.1f} s")
        try:
            if args.only_overhead:
                spans = [s for spans in rollouts(stack, tasks[:2], 2) for s in spans]
                overhead = gateway_overhead_ms(stack, spans[0].prompt_ids, args.pairs)
                return {"overhead_ms": overhead["gateway"], "floor_ms": overhead["forwarder"]}
            tok_s, spans = throughput(stack, tasks, args.batch)
            numbers = {"tok_s": tok_s, "spans": len(spans)}
            numbers["max_logprob_diff"] = max_gap(reference, spans)
            numbers["sync_s"] = sync_s(stack, reference)
            if cfg.kind == "vllm" and args.pairs > 0:
                prompt = spans[0].prompt_ids
                overhead = gateway_overhead_ms(stack, prompt, args.pairs)
                numbers["overhead_ms"] = overhead["gateway"]
                numbers["floor_ms"] = overhead["forwarder"]
        finally:
            stack.close()
    print(f"{cfg.kind}: " + ", ".join(f"{k}={v:.4g}" for k, v in numbers.items()))
    return numbers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=128, help="concurrent rollouts")
    parser.add_argument("--pairs", type=int, default=200, help="gateway overhead samples")
    parser.add_argument("--model", default="", help="model dir (default: the h64 calculator)")
    default_python = os.environ.get("TRACERL_VLLM_PYTHON", ".venv-vllm/bin/python")
    parser.add_argument("--vllm-python", default=default_python)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument(
        "--only-overhead", action="store_true", help="measure only gateway_overhead_ms (vLLM)"
    )
    args = parser.parse_args()
    model = Path(args.model) if args.model else h64_model()
    base = EngineConfig(max_batch_size=args.batch, log_dir=tempfile.mkdtemp(prefix="logs-"))
    vllm_cfg = base.model_copy(
        update={"kind": "vllm", "python": args.vllm_python, "kv_cache_gib": 0.5}
    )
    if args.only_overhead:
        vllm = measure(model, vllm_cfg, args)
        overheads = {
            "gateway_overhead_ms": vllm["overhead_ms"],
            "forwarder_overhead_ms": vllm["floor_ms"],
        }
        print(json.dumps({"model": model.name, **overheads}))
        return
    inproc = measure(model, base, args)
    server = measure(model, base.model_copy(update={"kind": "hf_server"}), args)
    out: dict[str, Any] = {
        "batch": args.batch,
        "model": model.name,
        "hf_inproc_tok_s": inproc["tok_s"],
        "hf_server_tok_s": server["tok_s"],
        "hf_sync_s": server["sync_s"],
        "hf_inproc_sync_s": inproc["sync_s"],
    }
    gaps = [inproc["max_logprob_diff"], server["max_logprob_diff"]]
    if not args.skip_vllm:
        vllm = measure(model, vllm_cfg, args)
        out |= {
            "vllm_tok_s": vllm["tok_s"],
            "vllm_sync_s": vllm["sync_s"],
            "gateway_overhead_ms": vllm["overhead_ms"],
            "forwarder_overhead_ms": vllm["floor_ms"],
        }
        gaps.append(vllm["max_logprob_diff"])
    out["max_logprob_diff"] = max(gaps)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
