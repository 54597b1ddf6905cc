"""The gateway's event loop never waits on the store or on tokenizing: /health answers at
once while a slow store write or a multi-megabyte prompt is being handled, and an
attempt's spans keep their order when their writes run off the loop."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store import StoreError
from tracerl.store.sqlite import SqliteStore
from tracerl.types import Rollout, Span

from .scripted import ScriptedEngine, running_rollout

BOUND_S = 1.0
"""Slowest /health answer allowed while the slow request runs (it took 3-14 s before)."""


class SlowStore(SqliteStore):
    """A store whose rollout lookups and span writes take `delay_s` each (in memory, so
    every lookup goes to a store thread: it has no second connection for rollout_now)."""

    delay_s = 0.0

    def get_rollout(self, rollout_id: str) -> Rollout:
        time.sleep(self.delay_s)
        return super().get_rollout(rollout_id)

    def append_spans(self, spans: list[Span]) -> list[int]:
        time.sleep(self.delay_s)
        return super().append_spans(spans)

    def append_groups(self, groups: list[list[Span]]) -> list[list[int] | StoreError]:
        time.sleep(self.delay_s)  # the gateway's grouped writes (record._Writes)
        return super().append_groups(groups)


@pytest.fixture(params=[512])
def served(
    tiny_model_dir: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[BackgroundServer, SlowStore]]:
    """The gateway over a scripted engine of `request.param` positions, a SlowStore."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = SlowStore(":memory:")
    engine = ScriptedEngine(tokenizer, max_context=request.param)
    gateway = Gateway(store, {"policy": ServedModel("policy", engine, tokenizer)})
    server = serve_in_thread(create_app(gateway))
    yield server, store
    server.stop()
    gateway.close()
    store.close()


def _health_while(url: str, slow: Callable[[], httpx.Response]) -> tuple[list[float], int]:
    """Run `slow` on a thread; time every GET /health sent while it runs. Returns the
    latencies and the status `slow` got."""
    got: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: got.append(slow()))
    worker.start()
    latencies = []
    with httpx.Client(base_url=url, timeout=60) as http:
        time.sleep(0.3)  # let the slow request reach the gateway
        while worker.is_alive():
            started = time.perf_counter()
            assert http.get("/health").status_code == 200
            if worker.is_alive():  # only answers given while it still ran count
                latencies.append(time.perf_counter() - started)
            time.sleep(0.05)
    worker.join()
    return latencies, got[0].status_code


def test_health_answers_while_the_store_is_slow(served) -> None:  # type: ignore[no-untyped-def]
    server, store = served
    rid = running_rollout(store)
    store.delay_s = 1.5
    body = {"model": "policy", "messages": [{"role": "user", "content": "What is 37+48?"}]}

    def chat() -> httpx.Response:
        return httpx.post(f"{server.url}/rollouts/{rid}/v1/chat/completions", json=body, timeout=60)

    latencies, status = _health_while(server.url, chat)
    assert status == 200
    assert len(latencies) >= 3 and max(latencies) < BOUND_S, latencies
    store.delay_s = 0.0
    assert len(store.spans(rid)) == 1


# A context long enough that the 1.5 MB prompt passes the byte bound (PromptBuilder refuses,
# before any BPE, a text longer in bytes than the context could hold: 200k positions x the
# tiny tokenizer's 13-byte longest token) and is tokenized, seconds of BPE, into ~1M ids,
# then refused as too long in tokens.
@pytest.mark.parametrize("served", [200_000], indirect=True)
def test_health_answers_while_a_huge_prompt_is_tokenized(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    huge = "What is 37+48? " * 100_000  # 1.5 MB: seconds of BPE
    body = {"model": "policy", "messages": [{"role": "user", "content": huge}]}

    def chat() -> httpx.Response:
        return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)

    latencies, status = _health_while(server.url, chat)
    assert status == 400  # far past the context, refused once tokenized
    assert len(latencies) >= 3 and max(latencies) < BOUND_S, latencies


def test_concurrent_calls_of_one_attempt_keep_their_span_order(served) -> None:  # type: ignore[no-untyped-def]
    server, store = served
    rid = running_rollout(store)
    store.delay_s = 0.05
    url = f"{server.url}/rollouts/{rid}/v1/chat/completions"

    def chat(i: int) -> None:
        ask = {"model": "policy", "messages": [{"role": "user", "content": f"What is {i}+1?"}]}
        assert httpx.post(url, json=ask, timeout=60).status_code == 200

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.delay_s = 0.0
    spans = store.spans(rid)
    assert [s.seq for s in spans] == list(range(6))
    assert len({s.id for s in spans}) == 6
