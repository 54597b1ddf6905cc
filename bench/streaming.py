"""Time to first byte of a streamed completion through the gateway, against one decode step.

The gateway serves the tiny model (built here, random weights, default shape) on the hf
engine; an httpx client asks for 128-token chat completions one at a time, streamed and
not. A streamed call's first content byte should arrive after the prompt's prefill and one
sampled token plus the gateway's own overhead, not after the whole completion: the engine
hands out each token as its decode step samples it. Only completions that ran the full 128
tokens are counted (a random model sometimes samples its end token early).

Last line: JSON with ttfb_ms_p50 (streamed, first content byte), total_ms_p50 (streamed,
last byte), decode_step_ms_p50 (engine alone, per token), engine_first_token_ms_p50 (engine
alone: prefill and one sampled token, the floor under ttfb), nonstream_ms_p50 (the same call
unstreamed: the first byte a client got before token streaming), runs.

Where the rest of ttfb goes (measured 2026-12 with timestamps inside the gateway): ~1.5 ms
from the client's send to the route (HTTP, validation), ~0.5 ms of prompt rendering and
thread hops before the engine has the request, ~0.5 ms from the sampled token to the
client; and with random weights about one call in three needs 2-5 tokens before any
visible content (a first token that is part of a multi-byte character, or whitespace the
reply strips). On a 2-core machine shared with other work the whole figure swings 6-18 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "calculator"))
TOKENS = 128
MESSAGES = [{"role": "user", "content": "What is 37+48?"}]


def build_model(path: Path) -> Path:
    """The tiny model (default shape), random weights, tokenizer from calculator texts."""
    from expert import demonstrations

    from tracerl.models.template import render_chat
    from tracerl.models.tiny import TinyModelConfig, build_tiny_model

    texts = [render_chat(d["messages"], d["tools"]) for d in demonstrations(300, seed=7)]
    return build_tiny_model(path, texts, TinyModelConfig())


def streamed(client: httpx.Client, url: str, seed: int) -> tuple[float, float, int] | None:
    """(first content byte s, last byte s, tokens) of one streamed call; None if cut short."""
    body = {
        "model": "policy",
        "messages": MESSAGES,
        "max_tokens": TOKENS,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, tokens = time.perf_counter(), None, 0
    with client.stream("POST", url, json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    total = time.perf_counter() - start
    return (first, total, tokens) if first is not None and tokens == TOKENS else None


def plain(client: httpx.Client, url: str, seed: int) -> float | None:
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": TOKENS, "seed": seed}
    start = time.perf_counter()
    reply = client.post(url, json=body).json()
    took = time.perf_counter() - start
    return took if reply["usage"]["completion_tokens"] == TOKENS else None


def first_token(engine, prompt: list[int], seed: int) -> float:  # type: ignore[no-untyped-def]
    """Seconds the engine alone takes to prefill the prompt and sample one token: the part
    of a first byte that no gateway can remove."""
    from tracerl.types import SamplingParams

    start = time.perf_counter()
    asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=1, seed=seed)))
    return time.perf_counter() - start


def decode_step(engine, prompt: list[int], seed: int) -> float | None:  # type: ignore[no-untyped-def]
    """Seconds per sampled token of the engine alone (no gateway), full-length runs only."""
    from tracerl.types import SamplingParams

    params = SamplingParams(max_tokens=TOKENS, seed=seed)
    start = time.perf_counter()
    gen = asyncio.run(engine.generate(prompt, params))
    took = time.perf_counter() - start
    return took / TOKENS if len(gen.completion_ids) == TOKENS else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=15, help="full-length completions per measure")
    args = p.parse_args()
    from tracerl.engines.hf import HFEngine
    from tracerl.gateway import Gateway, ServedModel, create_app
    from tracerl.gateway.tito import PromptBuilder
    from tracerl.server import serve_in_thread

    model = build_model(Path(tempfile.mkdtemp()) / "model")
    engine = HFEngine(model)
    server = serve_in_thread(
        create_app(Gateway(None, {"policy": ServedModel("policy", engine, engine.tokenizer)}))
    )
    url = f"{server.url}/v1/chat/completions"
    prompt = PromptBuilder(engine.tokenizer).build(MESSAGES, None, None).ids  # type: ignore[arg-type]
    try:
        with httpx.Client(timeout=120) as client:
            for seed in range(3):  # warm up
                streamed(client, url, 1000 + seed)
            runs = collect(lambda s: streamed(client, url, s), args.runs)
            flat = collect(lambda s: plain(client, url, s), args.runs)
        steps = collect(lambda s: decode_step(engine, prompt, s), args.runs)
        firsts = collect(lambda s: first_token(engine, prompt, s), args.runs)
    finally:
        server.stop()
        engine.close()
    out = {
        "ttfb_ms_p50": round(1000 * statistics.median(r[0] for r in runs), 2),
        "total_ms_p50": round(1000 * statistics.median(r[1] for r in runs), 2),
        "decode_step_ms_p50": round(1000 * statistics.median(steps), 3),
        "engine_first_token_ms_p50": round(1000 * statistics.median(firsts), 3),
        "nonstream_ms_p50": round(1000 * statistics.median(flat), 2),
        "runs": len(runs),
        "tokens": TOKENS,
    }
    print(json.dumps(out))


def collect(measure, want: int) -> list:  # type: ignore[no-untyped-def]
    """`want` results of measure(seed) that ran the full length (at most 8x the tries)."""
    out = []
    for seed in range(want * 8):
        result = measure(seed)
        if result is not None:
            out.append(result)
        if len(out) == want:
            break
    if not out:
        raise SystemExit("no completion ran the full length")
    return out


if __name__ == "__main__":
    main()
