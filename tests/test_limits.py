"""Limits with clear errors: body size (announced and streamed), a body that never arrives,
prompts over the context, n, max_tokens, calls in flight per rollout, and a client that
disconnects: its generation is cancelled and nothing is recorded."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from urllib.parse import urlparse

import httpx
import orjson
import pytest

from tracerl.auth import Keys
from tracerl.limits import Limits

ROOT = Path(__file__).resolve().parents[1]
# body_timeout_s: short, so the slow-body test answers fast, but not 0.5 s: on a loaded 2-core
# box a whole small body once took longer to reach the server's thread (a 408 for a valid call).
LIMITS = Limits(max_body_bytes=20_000, body_timeout_s=2.0, max_n=2, max_tokens=100, max_in_flight=2)


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_security", ROOT / "bench/security.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


security = _bench()


@pytest.fixture(scope="module")
def service(tiny_model_dir: Path) -> Iterator:  # type: ignore[type-arg]
    s = security.start_service(tiny_model_dir, Keys(), LIMITS)
    yield s
    s.close()


@pytest.fixture
def slow(service):  # type: ignore[no-untyped-def]
    service.engine.delay_s = 1.5
    yield service
    service.engine.delay_s = 0.0


def _chat(**extra: object) -> dict[str, object]:
    return {"model": "policy", "messages": security.MESSAGES, **extra}


def _error(resp: httpx.Response, status: int) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    error: dict[str, object] = resp.json()["error"]
    assert error["message"]
    return error


def test_a_body_announced_too_large_is_413(service) -> None:  # type: ignore[no-untyped-def]
    big = _chat(messages=[{"role": "user", "content": "x" * 30_000}])
    error = _error(httpx.post(f"{service.url}/v1/chat/completions", json=big), 413)
    assert error["code"] == "too_large"
    resp = httpx.post(
        f"{service.url}/store/tasks", json=[{"id": "x", "input": {"a": "y" * 30_000}}]
    )
    _error(resp, 413)


def test_a_body_streamed_past_the_limit_is_413(service) -> None:  # type: ignore[no-untyped-def]
    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(30):
            yield b"x" * 1000

    json = {"content-type": "application/json"}
    resp = httpx.post(f"{service.url}/v1/chat/completions", content=chunks(), headers=json)
    assert "content-length" not in resp.request.headers
    _error(resp, 413)


def test_a_body_that_never_arrives_gets_an_answer(service) -> None:  # type: ignore[no-untyped-def]
    url = urlparse(service.url)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Content-Length: 10000\r\n\r\n"
    )
    started = time.monotonic()
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(head.encode() + b'{"model": ')  # 10 bytes of the 10,000 announced
        reply = sock.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 408"), reply
    assert "request_timeout" in reply and time.monotonic() - started < 5


def test_prompts_over_the_context_are_refused_before_sampling(service) -> None:  # type: ignore[no-untyped-def]
    started = service.engine.started
    long = _chat(messages=[{"role": "user", "content": "7 + " * 3000}])
    error = _error(httpx.post(f"{service.url}/v1/chat/completions", json=long), 400)
    assert error["code"] == "context_length_exceeded"
    ids = {"model": "policy", "prompt": [5] * 600}
    error = _error(httpx.post(f"{service.url}/v1/completions", json=ids), 400)
    assert error["code"] == "context_length_exceeded"
    assert service.engine.started == started  # the engine never saw either


@pytest.fixture(scope="module")
def roomy(tiny_model_dir: Path) -> Iterator:  # type: ignore[type-arg]
    """The service with the default limits: a 10 MB body gets through to the route."""
    s = security.start_service(tiny_model_dir, Keys())
    yield s
    s.close()


@pytest.mark.parametrize("api", ["chat", "completions", "messages"])
def test_a_long_prompt_is_refused_before_it_is_tokenized(roomy, api: str) -> None:  # type: ignore[no-untyped-def]
    text = "x" * 10 * 2**20  # one 10 MB word: tens of seconds of BPE merges on this machine
    path, body = {
        "chat": ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": text}])),
        "completions": ("/v1/completions", {"model": "policy", "prompt": text}),
        "messages": ("/v1/messages", {"model": "policy", "max_tokens": 5,
                                      "messages": [{"role": "user", "content": text}]}),
    }[api]  # fmt: skip
    payload = orjson.dumps(body)
    started = time.monotonic()
    resp = httpx.post(
        f"{roomy.url}{path}",
        content=payload,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    elapsed = time.monotonic() - started
    assert resp.status_code == 400, resp.text[:300]
    if api == "messages":  # Anthropic's shape and words (Claude clients compact on them)
        assert resp.json()["type"] == "error"
        assert resp.json()["error"]["message"].startswith("prompt is too long")
    else:
        error = resp.json()["error"]
        assert error["code"] == "context_length_exceeded", error
        assert error["param"] == ("prompt" if api == "completions" else "messages")
    assert elapsed < 1.0, elapsed
    assert roomy.engine.started == 0


def test_n_and_max_tokens_are_bounded(service) -> None:  # type: ignore[no-untyped-def]
    url = f"{service.url}/v1/chat/completions"
    assert _error(httpx.post(url, json=_chat(n=3)), 400)["param"] == "n"
    assert httpx.post(url, json=_chat(n=2)).status_code == 200
    assert _error(httpx.post(url, json=_chat(max_tokens=101)), 400)["param"] == "max_tokens"
    assert _error(httpx.post(url, json=_chat(max_tokens=0)), 400)["param"] == "max_tokens"
    assert httpx.post(url, json=_chat(max_tokens=100)).status_code == 200
    done = httpx.post(
        f"{service.url}/v1/completions",
        json={"model": "policy", "prompt": "1", "max_tokens": 10**30},
    )
    assert _error(done, 400)["param"] == "max_tokens"


def test_calls_in_flight_per_rollout_are_capped(slow) -> None:  # type: ignore[no-untyped-def]
    world = security.new_world(slow)
    url = f"{slow.url}/rollouts/{world.a}/v1/chat/completions"

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as http:
            first = [asyncio.create_task(http.post(url, json=_chat())) for _ in range(2)]
            await asyncio.sleep(0.5)  # both in flight now
            third = await http.post(url, json=_chat())
            other = await http.post(f"{slow.url}/rollouts/{world.b}/reward", json={"value": 1})
            assert other.status_code == 200  # other rollouts are not held back
            return [*(r.status_code for r in await asyncio.gather(*first)), third.status_code]

    statuses = asyncio.run(burst())
    assert statuses == [200, 200, 429]
    assert httpx.post(url, json=_chat(), timeout=30).status_code == 200  # slots came back


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_its_call(slow, stream: bool) -> None:  # type: ignore[no-untyped-def]
    world = security.new_world(slow)
    engine, store = slow.engine, slow.store
    cancelled = engine.cancelled
    url = f"{slow.url}/rollouts/{world.a}/v1/chat/completions"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=_chat(stream=stream), timeout=0.5)
    deadline = time.monotonic() + 5
    while engine.cancelled == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.cancelled == cancelled + 1
    time.sleep(slow.engine.delay_s)  # past when the generation would have ended
    assert store.spans(world.a) == []
    # The attempt goes on: its next call is recorded as its first span.
    slow.engine.delay_s = 0.0
    assert httpx.post(url, json=_chat()).status_code == 200
    assert [s.seq for s in store.spans(world.a)] == [0]
