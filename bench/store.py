"""Throughput of the store over HTTP, as runners on other machines would use it.

A uvicorn server (separate process, file-backed SqliteStore in a temp dir) serves the store;
several client threads share one StoreClient and each loops: claim a batch, then per
rollout record its spans in one call and finish it with the final reward. Prints a
summary; the last line is one JSON object with `rollouts_per_s` and per-call latencies.

    .venv/bin/python bench/store.py [--rollouts 3000 --threads 8 ...]

Where the time goes (2-core AVX2 machine shared with other jobs, load average 5-11; py-spy
of both processes, 2026-12). Each rollout (one claim share, one add_spans of 6 spans x 350
tokens, one finish) costs ~3.3 ms of server CPU and ~3.0 ms of client CPU: ~6.3 ms in all,
so both cores to itself would give at most ~320 rollouts/s, and the 123-161 rollouts/s
measured are what the bench's share of a loaded machine allows (548 on a faster, idle CPU).
The client's time is httpx: waiting on the socket, the connection pool's lock that the 8
threads sharing one StoreClient take turns on (~10% of its samples), and validating the
replies. The server's busy samples: SQLite ~32% (statements and commits, and store threads
waiting on the store's one connection lock), the FastAPI/Starlette stack with the doors,
keys and limits middlewares ~18%, uvicorn's parsing and socket sends ~16%, parsing and
checking bodies ~16% (pydantic's validate_json; the range checks of token ids already run
in C), thread-pool hops ~11% (submit, and the workers' turns at the GIL). Nothing there is
cheap to remove without changing what the API checks; a faster machine or fewer, larger
calls (add_spans of several rollouts at once) are what move the number.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict

from tracerl.store.http import StoreClient
from tracerl.types import Rollout, RolloutStatus, Span, Task


class BenchConfig(BaseModel):
    """What to measure; every field is also a --flag."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    rollouts: int = 3000
    """Rollouts to push through claim -> spans -> finish."""
    threads: int = 8
    """Concurrent client threads (runners), sharing one StoreClient."""
    claim_batch: int = 8
    """Rollouts per claim call."""
    turns: int = 6
    """Spans per rollout."""
    prompt_tokens: int = 300
    """Prompt length of every span."""
    completion_tokens: int = 50
    """Completion length of every span."""


def parse_args() -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, field in BenchConfig.model_fields.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=field.default)
    return BenchConfig(**vars(parser.parse_args()))


def cpu_s() -> float:
    """CPU seconds this process has used, all threads."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def serve(path: str) -> None:
    """Child process: serve a file store; answer each stdin line with its CPU seconds."""
    from tracerl.server import serving
    from tracerl.store import SqliteStore
    from tracerl.store.http import create_store_app

    with serving(create_store_app(SqliteStore(path))) as url:
        print(url, flush=True)
        for _ in sys.stdin:
            print(cpu_s(), flush=True)


class Server:
    """The serving child process, seen from the bench."""

    def __init__(self, db: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", db],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.url = self._line()

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def cpu_s(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("cpu\n")
        self.proc.stdin.flush()
        return float(self._line())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def make_spans(r: Rollout, cfg: BenchConfig, rng: np.random.Generator) -> list[Span]:
    prompt = rng.integers(0, 50_000, cfg.prompt_tokens).tolist()
    completion = rng.integers(0, 50_000, cfg.completion_tokens).tolist()
    logprobs = (-rng.random(cfg.completion_tokens)).tolist()
    return [
        Span(
            id=f"{r.id}-{r.attempt}-{seq}",
            rollout_id=r.id,
            attempt=r.attempt,
            seq=seq,
            role="policy",
            policy_version=0,
            prompt_ids=prompt,
            completion_ids=completion,
            logprobs=logprobs,
            messages=[{"role": "user", "content": "What is 17 * 23?"}],
            response={"content": "391", "finish_reason": "stop"},
        )
        for seq in range(cfg.turns)
    ]


def runner(client: StoreClient, k: int, cfg: BenchConfig, lat: dict[str, list[float]]) -> None:
    rng = np.random.default_rng(k)
    while True:
        t0 = time.perf_counter()
        batch = client.claim(f"runner-{k}", n=cfg.claim_batch, lease_s=60)
        lat["claim"].append(time.perf_counter() - t0)
        if not batch:
            return
        for r in batch:
            spans = make_spans(r, cfg, rng)
            t0 = time.perf_counter()
            client.add_spans(spans)
            t1 = time.perf_counter()
            client.finish(r.id, r.attempt, RolloutStatus.succeeded, answer="391", reward=1.0)
            t2 = time.perf_counter()
            lat["spans"].append(t1 - t0)
            lat["finish"].append(t2 - t1)


def run(cfg: BenchConfig, server: Server) -> dict[str, float]:
    client = StoreClient(server.url)
    client.add_tasks([Task(id=f"t{i}", input={"question": f"{i}*3"}) for i in range(100)])
    for start in range(0, cfg.rollouts, 1000):
        client.enqueue([f"t{i % 100}" for i in range(start, min(cfg.rollouts, start + 1000))])
    lat: dict[str, list[float]] = {"claim": [], "spans": [], "finish": []}
    threads = [
        threading.Thread(target=runner, args=(client, k, cfg, lat)) for k in range(cfg.threads)
    ]
    t0, server_cpu0, client_cpu0 = time.perf_counter(), server.cpu_s(), cpu_s()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    # CPU per rollout does not depend on what else the machine is doing; wall time does.
    server_ms = (server.cpu_s() - server_cpu0) / cfg.rollouts * 1e3
    client_ms = (cpu_s() - client_cpu0) / cfg.rollouts * 1e3
    counts = client.counts()
    assert counts["succeeded"] == cfg.rollouts, counts
    sample = client.rollouts(status=RolloutStatus.succeeded, limit=1)[0]
    assert len(client.spans(sample.id)) == cfg.turns
    client.close()
    calls = sum(len(v) for v in lat.values())
    out = {
        "rollouts_per_s": round(cfg.rollouts / wall, 1),
        "requests_per_s": round(calls / wall),
        "server_cpu_ms_per_rollout": round(server_ms, 3),
        "client_cpu_ms_per_rollout": round(client_ms, 3),
    }
    for name, xs in lat.items():
        out[f"p50_{name}_ms"] = round(float(np.percentile(xs, 50)) * 1e3, 2)
        out[f"p99_{name}_ms"] = round(float(np.percentile(xs, 99)) * 1e3, 2)
    return out | {"wall_s": round(wall, 2)} | cfg.model_dump()


def main() -> None:
    cfg = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(str(Path(tmp) / "store.db"))
        try:
            result = run(cfg, server)
        finally:
            server.close()
    print(
        f"{result['rollouts_per_s']} rollouts/s over HTTP, {cfg.threads} client threads, "
        f"{cfg.turns} spans x {cfg.prompt_tokens}+{cfg.completion_tokens} tokens each; "
        f"server CPU {result['server_cpu_ms_per_rollout']} ms/rollout "
        f"(one core's worth: {1000 / result['server_cpu_ms_per_rollout']:.0f} rollouts/s)"
    )
    print(orjson.dumps(result).decode())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        main()
