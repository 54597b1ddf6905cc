"""Engine throughput: N concurrent requests against the same N one at a time.

Builds a random tiny Llama (hidden 192, 4 layers, byte-level BPE vocab ~400 with split
digits) in a temporary directory, serves it with HFEngine, and samples `--new-tokens`
tokens per request. Also times HF `generate` at batch 1 as a reference point. The last line
printed is JSON: batched_tok_per_s, sequential_tok_per_s, speedup (and the settings).

    OMP_NUM_THREADS=1 .venv/bin/python bench/engine.py --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

import torch
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from tracerl.engines.hf import HFEngine
from tracerl.models.tiny import TinyModelConfig, build_tiny_model
from tracerl.types import Generation, SamplingParams


def build_model(path: Path) -> PreTrainedTokenizerBase:
    """A random tiny model (the demo's shape) with a tokenizer trained on arithmetic text."""
    corpus = [
        f"what is {a} + {b}? call add({a}, {b}) -> {a + b}" for a in range(40) for b in range(7)
    ]
    build_tiny_model(path, corpus, TinyModelConfig(num_heads=6))
    return AutoTokenizer.from_pretrained(path)


async def _timed(
    calls: list[Callable[[], Awaitable[Generation]]], concurrent: bool
) -> tuple[float, list[Generation]]:
    start = time.perf_counter()
    if concurrent:
        gens = list(await asyncio.gather(*[call() for call in calls]))
    else:
        gens = [await call() for call in calls]
    return time.perf_counter() - start, gens


def _hf_generate_tok_per_s(engine: HFEngine, prompt: list[int], new_tokens: int) -> float:
    """HF generate, batch 1, sampling with a KV cache: the reference MACHINE-NOTES quotes."""
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    out = cast(LlamaForCausalLM, engine.model).generate(
        ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, pad_token_id=0
    )
    return (out.shape[1] - len(prompt)) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_model(Path(tmp))
        engine = HFEngine(tmp, max_batch_size=args.requests)
    prompts = [
        tokenizer(f"what is {i} + {2 * i + 1}? call").input_ids for i in range(args.requests)
    ]
    params = [SamplingParams(max_tokens=args.new_tokens, seed=i) for i in range(args.requests)]
    calls: list[Callable[[], Awaitable[Generation]]] = [
        lambda p=p, s=s: engine.generate(p, s)  # type: ignore[misc]
        for p, s in zip(prompts, params, strict=True)
    ]

    async def run() -> dict[str, float]:
        await engine.generate(prompts[0], SamplingParams(max_tokens=8))  # warm up
        seq_s, seq = await _timed(calls, concurrent=False)
        bat_s, bat = await _timed(calls, concurrent=True)
        # Seeded requests should sample the same tokens alone or batched.
        same = sum(a.completion_ids == b.completion_ids for a, b in zip(seq, bat, strict=True))
        tokens = sum(len(g.completion_ids) for g in bat)
        return {"tokens": tokens, "sequential_s": seq_s, "batched_s": bat_s, "same": same}

    timing = asyncio.run(run())
    stats = engine.stats
    engine.close()
    hf_b1 = _hf_generate_tok_per_s(engine, prompts[0], args.new_tokens)
    batched = timing["tokens"] / timing["batched_s"]
    sequential = timing["tokens"] / timing["sequential_s"]
    result = {
        "batched_tok_per_s": round(batched, 1),
        "sequential_tok_per_s": round(sequential, 1),
        "speedup": round(batched / sequential, 2),
        "hf_generate_batch1_tok_per_s": round(hf_b1, 1),
        "tokens": int(timing["tokens"]),
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "peak_rows": stats.peak_rows,
        "seeded_identical": int(timing["same"]),
    }
    print(f"{args.requests} requests x {args.new_tokens} tokens, {args.threads} thread(s)")
    print(f"  one at a time : {sequential:8.0f} tok/s")
    print(f"  concurrent    : {batched:8.0f} tok/s  (peak {stats.peak_rows} rows per step)")
    print(f"  HF generate b1: {hf_b1:8.0f} tok/s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
