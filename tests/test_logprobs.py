"""The most likely alternatives at each sampled position (`top_logprobs`): taken by the
transformers engine from the distribution it samples, carried by its server to RemoteEngine
exactly as vLLM answers, and served by the gateway in OpenAI's chat and legacy completions
shapes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tracerl.engines.hf import HFEngine
from tracerl.engines.hf_server import create_app as server_app
from tracerl.engines.remote import RemoteEngine
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.server import serve_in_thread
from tracerl.types import Generation, SamplingParams

MESSAGES = [{"role": "user", "content": "What is 37+48?"}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[HFEngine]:
    e = HFEngine(tiny_model_dir)
    yield e
    e.close()


def _prompt(engine: HFEngine) -> list[int]:
    return list(engine.tokenizer.encode("37+48="))


def _reference_top(engine: HFEngine, prompt: list[int], gen: Generation, k: int) -> list:
    """Top-k (id, log-prob) at each position of `gen`, from one forward pass at temperature 1."""
    ids = torch.tensor([prompt + gen.completion_ids])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(prompt) - 1 : -1].float()
    values, indices = torch.log_softmax(logits, -1).topk(k, -1)
    return [
        list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(indices, values, strict=True)
    ]


def _assert_same_top(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert [lp for _, lp in g] == pytest.approx([lp for _, lp in w], abs=1e-4)


def test_the_engine_returns_the_distribution_it_sampled_from(engine: HFEngine) -> None:
    prompt = _prompt(engine)
    params = SamplingParams(max_tokens=6, temperature=0.0, top_logprobs=3)
    gen = asyncio.run(engine.generate(prompt, params))
    _assert_same_top(gen.top_logprobs, _reference_top(engine, prompt, gen, 3))
    # Greedy: each sampled token is the most likely one, with the log-prob recorded for it.
    for token, logprob, top in zip(gen.completion_ids, gen.logprobs, gen.top_logprobs, strict=True):
        assert top[0][0] == token and top[0][1] == pytest.approx(logprob, abs=1e-5)
    plain = asyncio.run(engine.generate(prompt, params.model_copy(update={"top_logprobs": 0})))
    assert plain.completion_ids == gen.completion_ids and plain.top_logprobs == []


def test_the_engine_server_carries_them_as_vllm_does(engine: HFEngine, tmp_path: Path) -> None:
    server = serve_in_thread(server_app(engine))
    remote = RemoteEngine(
        [server.url], tokenizer=engine.tokenizer, max_context=engine.max_context,
        eos_token_ids=engine.eos_token_ids, weights_dir=tmp_path,
    )  # fmt: skip
    prompt = _prompt(engine)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, top_logprobs=4)
    try:
        far = asyncio.run(remote.generate(prompt, params))
    finally:
        remote.close()
        server.stop()
    near = asyncio.run(engine.generate(prompt, params))
    assert far.completion_ids == near.completion_ids
    _assert_same_top(far.top_logprobs, near.top_logprobs)
    assert all(len(top) == 4 for top in far.top_logprobs)


@pytest.fixture(scope="module")
def gateway_url(engine: HFEngine) -> Iterator[str]:
    gateway = Gateway(None, {"policy": ServedModel("policy", engine, engine.tokenizer, 6)})
    server = serve_in_thread(create_app(gateway))
    yield server.url
    server.stop()
    gateway.close()


def test_chat_completions_serve_top_logprobs(gateway_url: str, engine: HFEngine) -> None:
    body = {"model": "policy", "messages": MESSAGES, "temperature": 0, "logprobs": True}
    resp = httpx.post(f"{gateway_url}/v1/chat/completions", json={**body, "top_logprobs": 3})
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert content
    for position in content:
        top = position["top_logprobs"]
        assert len(top) == 3 and {"token", "logprob", "bytes"} <= set(top[0])
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["token"] == position["token"]  # greedy: the sampled token is the best
        assert top[0]["logprob"] == pytest.approx(position["logprob"], abs=1e-5)
    bare = httpx.post(f"{gateway_url}/v1/chat/completions", json=body).json()
    assert all(p["top_logprobs"] == [] for p in bare["choices"][0]["logprobs"]["content"])
    too_many = httpx.post(f"{gateway_url}/v1/chat/completions", json={**body, "top_logprobs": 21})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "top_logprobs"


def test_legacy_completions_serve_top_logprobs(gateway_url: str) -> None:
    body = {"model": "policy", "prompt": "37+48=", "temperature": 0, "max_tokens": 4}
    resp = httpx.post(f"{gateway_url}/v1/completions", json={**body, "logprobs": 2})
    assert resp.status_code == 200, resp.text
    lp = resp.json()["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == len(lp["tokens"]) == len(lp["token_logprobs"]) > 0
    for token, logprob, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert isinstance(top, dict) and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)
        assert token in top
