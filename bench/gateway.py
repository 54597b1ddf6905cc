"""What the gateway itself costs per call.

Two servers, each in its own process, answer the same chat completion with the same bytes:
a bare FastAPI endpoint returning a canned response, and the tracerl gateway over a stub
engine that returns fixed tokens instantly — so the difference is the gateway's own work:
request validation, chat templating, tokenization, token-in/token-out bookkeeping, tool-call
parsing and recording the span in a SQLite file store. Both get the same calls from the
same httpx clients, sequentially and from 32 concurrent clients in 2 processes. Every call
belongs to a rollout and every second call extends the first (tool result appended), as an
agent's would; rollouts come in groups of GROUP that ask the same question, as a training
run's do (the gateway keeps a first call's prompt ids, so 7 in 8 first calls are repeats).

Both servers run side by side and are measured in alternating rounds (gateway then bare,
then bare then gateway, ...), each round's numbers taken back to back, and the medians over
rounds reported: on a shared machine a load change mid-run then moves both sides of a ratio
alike instead of biasing it.

Last line: JSON with p50_overhead_ms and p99_overhead_ms (median over rounds of the gateway's
minus the bare endpoint's sequential latency), req_per_s and bare_req_per_s (32 concurrent
clients), req_ratio (median of each round's gateway / bare throughput), and where the
throughput goes: each server process's CPU time per call in the concurrent phase
(gateway_cpu_ms, bare_cpu_ms; its threads together, read from the OS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "calculator"))

from agent import SYSTEM_PROMPT, TOOLS  # noqa: E402

REPLY = '<tool_call>{"name": "calculator", "arguments": {"expression": "37+48"}}</tool_call>'
PROCS = 2
"""Client processes for the concurrent phases."""
GROUP = 8
"""Rollouts that ask the same question (a GRPO group: the trainer's default group_size)."""
FIRST = [
    {"role": "system", "content": SYSTEM_PROMPT},
    {"role": "user", "content": "What is 37+48?"},
]


def build_model(path: Path) -> None:
    """A tiny model directory (only its tokenizer and template matter here)."""
    from expert import demonstrations

    from tracerl.models.template import render_chat
    from tracerl.models.tiny import TinyModelConfig, build_tiny_model

    texts = [render_chat(d["messages"], d["tools"]) for d in demonstrations(300, seed=7)]
    build_tiny_model(path, texts, TinyModelConfig(hidden_size=32, num_layers=1))


def serve(kind: str, model: str, port: int, store_path: str) -> None:
    """Run one of the two servers in this process."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import Response
    from transformers import AutoTokenizer

    from tracerl.engines.stub import StubEngine
    from tracerl.gateway import Gateway, ServedModel, create_app
    from tracerl.store.sqlite import SqliteStore

    tok = AutoTokenizer.from_pretrained(model)
    ids = [*tok.encode(REPLY, add_special_tokens=False), tok.eos_token_id]
    if kind == "bare":
        app = FastAPI()
        body = Path(store_path).read_bytes()  # a response the gateway produced, verbatim

        @app.post("/v1/chat/completions")
        @app.post("/rollouts/{rollout_id}/v1/chat/completions")
        async def bare() -> Response:
            return Response(body, media_type="application/json")

    else:
        store = SqliteStore(store_path)
        engine = StubEngine(ids, eos_token_ids=[tok.eos_token_id], max_context=512)
        app = create_app(Gateway(store, {"policy": ServedModel("policy", engine, tok)}))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


def start(kind: str, model: Path, port: int, extra: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, __file__, "--serve", kind, "--model", str(model), "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--store", str(extra)])
    for _ in range(300):
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
            return proc
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError(f"{kind} server did not start")


def first_turn(i: int) -> list[dict]:
    """The i-th rollout's first request: the rollouts of a group of GROUP ask the same."""
    a, b = 10 + (i // GROUP) % 80, 11 + (i // GROUP) // 80 % 80
    return [FIRST[0], {"role": "user", "content": f"What is {a}+{b}?"}]


def second_turn(i: int, first_reply: dict) -> list[dict]:
    msg = first_reply["choices"][0]["message"]
    call_id = msg["tool_calls"][0]["id"]
    return [*first_turn(i), msg, {"role": "tool", "tool_call_id": call_id, "content": "85"}]


def sequential(url: str, rollouts: list[str], bodies: dict) -> list[float]:
    """Latency of each call, one at a time (two calls per rollout)."""
    times = []
    with httpx.Client(timeout=30) as client:
        for i, rid in enumerate(rollouts):
            path = f"{url}/rollouts/{rid}/v1/chat/completions"
            t0 = time.perf_counter()
            first = client.post(path, json={**bodies, "messages": first_turn(i)}).json()
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            body = {**bodies, "messages": second_turn(i, first)}
            client.post(path, json=body).raise_for_status()
            times.append(time.perf_counter() - t0)
    return times


async def _client_share(url: str, rollouts: list[str], bodies: dict, clients: int) -> int:
    """One client process's share: `clients` concurrent callers over its rollouts."""
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for i, rid in enumerate(rollouts):
        queue.put_nowait((i, rid))
    headers = {"content-type": "application/json"}

    async def worker(client: httpx.AsyncClient) -> int:
        done = 0
        while not queue.empty():
            i, rid = queue.get_nowait()
            path = f"{url}/rollouts/{rid}/v1/chat/completions"
            body = orjson.dumps({**bodies, "messages": first_turn(i)})
            reply = await client.post(path, content=body, headers=headers)
            body = orjson.dumps({**bodies, "messages": second_turn(i, orjson.loads(reply.content))})
            (await client.post(path, content=body, headers=headers)).raise_for_status()
            done += 2
        return done

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        return sum(await asyncio.gather(*(worker(client) for _ in range(clients))))


def _run_share(args: tuple[str, list[str], dict, int]) -> int:
    return asyncio.run(_client_share(*args))


def concurrent(pool: Any, url: str, rollouts: list[str], bodies: dict, clients: int) -> float:
    """Requests per second with `clients` concurrent callers spread over the pool's PROCS
    client processes, so that the Python client is not what limits the measurement."""
    shares = [(url, rollouts[i::PROCS], bodies, clients // PROCS) for i in range(PROCS)]
    t0 = time.perf_counter()
    done = sum(pool.map(_run_share, shares))
    return done / (time.perf_counter() - t0)


def running_rollouts(url: str, n: int, tag: str) -> list[str]:
    from tracerl.store.http import StoreClient
    from tracerl.types import Task

    store = StoreClient(f"{url}/store")
    store.add_tasks([Task(id=f"{tag}-{i}", input={"q": i}) for i in range(n)])
    store.enqueue([f"{tag}-{i}" for i in range(n)])
    claimed = []
    while len(claimed) < n:
        claimed += store.claim("bench", min(256, n - len(claimed)), 3600.0)
    return [r.id for r in claimed]


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1000


@dataclass(frozen=True)
class Round:
    """One round's measurements of both servers, taken back to back."""

    gateway_seq: list[float]
    """Seconds per sequential gateway call."""
    bare_seq: list[float]
    """Seconds per sequential bare call."""
    gateway_rps: float
    """Gateway calls per second, concurrent clients."""
    bare_rps: float
    """Bare calls per second, concurrent clients."""
    gateway_cpu_ms: float
    """The gateway process's CPU milliseconds per call, concurrent clients."""
    bare_cpu_ms: float
    """The bare server's CPU milliseconds per call, concurrent clients."""


def cpu_s(proc: psutil.Process) -> float:
    """CPU seconds the process has used so far (user and system, all its threads)."""
    t = proc.cpu_times()
    return t.user + t.system


def measure_round(
    i: int,
    urls: dict[str, str],
    procs: dict[str, psutil.Process],
    pool: Any,
    args: argparse.Namespace,
    body: dict,
) -> Round:
    """Both servers, sequential then concurrent; which goes first alternates by round, so a
    load change on the machine biases neither (A B B A A B ...)."""
    gurl, burl = urls["gateway"], urls["bare"]
    seq = args.calls // args.rounds
    conc = args.concurrent_calls // args.rounds
    seq_rids = running_rollouts(gurl, seq // 2, f"s{i}")
    conc_rids = running_rollouts(gurl, conc // 2, f"c{i}")
    # The bare endpoint gets the same calls from the same clients (its rollout ids are names
    # only): the client's work is the same on both sides, the servers' is what differs.
    bare_seq = [f"bare-s{i}-{j}" for j in range(seq // 2)]
    bare_conc = [f"bare-c{i}-{j}" for j in range(conc // 2)]
    out: dict[str, Any] = {}
    for kind in ("gateway", "bare") if i % 2 == 0 else ("bare", "gateway"):
        if kind == "gateway":
            out["gateway_seq"] = sequential(gurl, seq_rids, body)
            used = cpu_s(procs[kind])
            out["gateway_rps"] = concurrent(pool, gurl, conc_rids, body, args.clients)
            calls = 2 * len(conc_rids)
        else:
            out["bare_seq"] = sequential(burl, bare_seq, body)
            used = cpu_s(procs[kind])
            out["bare_rps"] = concurrent(pool, burl, bare_conc, body, args.clients)
            calls = 2 * len(bare_conc)
        out[f"{kind}_cpu_ms"] = (cpu_s(procs[kind]) - used) / calls * 1000
    return Round(**out)


def summary(rounds: list[Round]) -> dict[str, Any]:
    """Medians over rounds of each round's own numbers (and of the ratios taken within a
    round), so one noisy round moves nothing much."""

    def med(f: Callable[[Round], float]) -> float:
        return round(statistics.median(f(r) for r in rounds), 3)

    return {
        "p50_overhead_ms": med(lambda r: pct(r.gateway_seq, 0.5) - pct(r.bare_seq, 0.5)),
        "p99_overhead_ms": med(lambda r: pct(r.gateway_seq, 0.99) - pct(r.bare_seq, 0.99)),
        "req_per_s": med(lambda r: r.gateway_rps),
        "bare_req_per_s": med(lambda r: r.bare_rps),
        "req_ratio": med(lambda r: r.gateway_rps / r.bare_rps),
        "gateway_p50_ms": med(lambda r: pct(r.gateway_seq, 0.5)),
        "bare_p50_ms": med(lambda r: pct(r.bare_seq, 0.5)),
        "gateway_cpu_ms": med(lambda r: r.gateway_cpu_ms),
        "bare_cpu_ms": med(lambda r: r.bare_cpu_ms),
        "rounds": len(rounds),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--serve", choices=["bare", "gateway"])
    p.add_argument("--model", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--store", default="")
    p.add_argument("--calls", type=int, default=1000, help="sequential calls per server")
    p.add_argument("--concurrent-calls", type=int, default=4000)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6, help="alternating rounds (medians reported)")
    args = p.parse_args()
    if args.serve:
        serve(args.serve, args.model, args.port, args.store)
        return
    from tracerl.server import free_port

    tmp = Path(tempfile.mkdtemp())
    model = tmp / "model"
    build_model(model)
    body = {"model": "policy", "tools": TOOLS, "max_tokens": 48}
    urls = {}
    servers = []
    try:
        gport = free_port()
        servers.append(start("gateway", model, gport, tmp / "traces.db"))
        urls["gateway"] = f"http://127.0.0.1:{gport}"
        canned = httpx.post(
            f"{urls['gateway']}/v1/chat/completions", json={**body, "messages": FIRST}
        )
        (tmp / "canned.json").write_bytes(canned.content)
        bport = free_port()
        servers.append(start("bare", model, bport, tmp / "canned.json"))
        urls["bare"] = f"http://127.0.0.1:{bport}"
        sequential(urls["gateway"], running_rollouts(urls["gateway"], 50, "warm"), body)
        sequential(urls["bare"], [f"warm-{i}" for i in range(50)], body)
        with multiprocessing.get_context("spawn").Pool(PROCS) as pool:
            pool.map(_run_share, [(urls["bare"], ["warm"], body, 1)] * PROCS)  # start them first
            procs = {kind: psutil.Process(p.pid) for kind, p in zip(urls, servers, strict=True)}
            rounds = [measure_round(i, urls, procs, pool, args, body) for i in range(args.rounds)]
    finally:
        for server in servers:
            server.terminate()
            server.wait()
    out = summary(rounds)
    head = f"{'round':8}{'bare p50':>10}{'gw p50':>10}{'bare req/s':>12}{'gw req/s':>12}"
    print(f"{head}{'ratio':>8}{'bare cpu ms':>13}{'gw cpu ms':>11}")
    for i, r in enumerate(rounds):
        bp, gp = pct(r.bare_seq, 0.5), pct(r.gateway_seq, 0.5)
        ratio = r.gateway_rps / r.bare_rps
        line = f"{i:<8}{bp:10.3f}{gp:10.3f}{r.bare_rps:12.0f}{r.gateway_rps:12.0f}{ratio:8.2f}"
        print(f"{line}{r.bare_cpu_ms:13.3f}{r.gateway_cpu_ms:11.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
