"""Soak: many rollouts through a serving process and runner processes; does anything grow?

A `tracerl serve`-like process (store in a SQLite file + gateway over a stub engine that
answers instantly, so only tracerl's own work is measured) and R `tracerl runner`
processes (the real entry point) running a 2-call agent: the model asks for a tool, the
agent appends the tool's result and asks again. All rollouts are queued up front. Every
`sample_every` finished rollouts the bench records each process's RSS (psutil), the store
file's size and its span count. Latency per rollout is the store's own claim -> finish
time, so the p99 per 1,000 rollouts shows whether later rollouts get slower.

Writes soak.png (RSS curves, p99 per 1,000 rollouts, store bytes vs spans) and prints a
last line of JSON: rollouts, rss_growth_mb (per process, after warm-up; goal <= 50 MB),
p99_ms_first / p99_ms_last, bytes_per_span.

    nice .venv/bin/python bench/soak.py [--rollouts 10000 --runners 2 --out soak.png]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from tracerl.examples import example_module

ROOT = Path(__file__).resolve().parents[1]
_calc = example_module("calculator", "agent")
REPLY = '<tool_call>{"name": "calculator", "arguments": {"expression": "37+48"}}</tool_call>'
TRACEMALLOC_ENV = "TRACERL_SOAK_TRACEMALLOC"
"""Set to a path prefix: the serving process traces its Python heap and writes its growth
after warm-up, at the middle and at the end to <prefix>.<n>.txt (slows it several times)."""
_client = httpx.Client(timeout=60)  # one per runner process, shared by its agent threads


def agent(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    """Two model calls: the tool call, then the answer after the tool's result."""
    msgs = [
        {"role": "system", "content": _calc.SYSTEM_PROMPT},
        {"role": "user", "content": f"What is {task['expression']}?"},
    ]
    body = {"model": model, "messages": msgs, "tools": _calc.TOOLS, "max_tokens": 32}
    headers = {"authorization": f"Bearer {api_key}"}
    url = f"{base_url}/chat/completions"
    first = _client.post(url, json=body, headers=headers).raise_for_status().json()
    msg = first["choices"][0]["message"]
    call = (msg.get("tool_calls") or [{"id": "c0"}])[0]["id"]
    msgs += [msg, {"role": "tool", "tool_call_id": call, "content": "85"}]
    second = _client.post(url, json={**body, "messages": msgs}, headers=headers)
    return str(second.raise_for_status().json()["choices"][0]["message"]["content"])


def serve(model: str, store_path: str, port: int, memory: int) -> None:
    """The serving process: store + gateway over a stub engine (tracerl serve's routes)."""
    import uvicorn
    from transformers import AutoTokenizer

    from tracerl.engines.stub import StubEngine
    from tracerl.gateway import Gateway, ServedModel, create_app
    from tracerl.store.sqlite import SqliteStore

    tok = AutoTokenizer.from_pretrained(model)
    ids = [*tok.encode(REPLY, add_special_tokens=False), tok.eos_token_id]
    engine = StubEngine(ids, eos_token_ids=[tok.eos_token_id], max_context=1024)
    served = {"policy": ServedModel("policy", engine, tok)}
    gateway = Gateway(SqliteStore(store_path), served, memory=memory)
    if os.environ.get(TRACEMALLOC_ENV):
        _trace_heap(os.environ[TRACEMALLOC_ENV])
    uvicorn.run(create_app(gateway), host="127.0.0.1", port=port, log_level="error")


def _trace_heap(prefix: str) -> None:
    """Opt-in diagnostic: trace the Python heap; each SIGUSR1 writes `<prefix>.<n>.txt`, the
    heap's growth since the first SIGUSR1 (top 25 tracebacks) beside the process's RSS."""
    import tracemalloc

    import psutil

    tracemalloc.start(8)
    snaps: list[tracemalloc.Snapshot] = []

    def dump(*_: object) -> None:
        snap = tracemalloc.take_snapshot()
        snaps.append(snap)
        rss = psutil.Process().memory_info().rss / 2**20
        lines = [f"rss_mb {rss:.1f} traced_mb {tracemalloc.get_traced_memory()[0] / 2**20:.1f}"]
        for stat in snap.compare_to(snaps[0], "traceback")[:25]:
            lines += [f"{stat.size_diff / 2**20:+.2f} MB {stat.count_diff:+d} blocks"]
            lines += [f"    {line}" for line in stat.traceback.format(limit=8)]
        Path(f"{prefix}.{len(snaps) - 1}.txt").write_text("\n".join(lines) + "\n")

    signal.signal(signal.SIGUSR1, dump)


def build_model(path: Path) -> None:
    """A tiny model directory: only its tokenizer and chat template are used."""
    from tracerl.models.template import render_chat
    from tracerl.models.tiny import TinyModelConfig, build_tiny_model

    demos = example_module("calculator", "expert").demonstrations(300, seed=7)
    texts = [render_chat(d["messages"], d["tools"]) for d in demos]
    build_tiny_model(path, texts, TinyModelConfig(hidden_size=32, num_layers=1))


def queue_rollouts(store_path: Path, n: int) -> None:
    """All tasks and rollouts queued before anything starts."""
    from tracerl.store.sqlite import SqliteStore
    from tracerl.types import Task

    store = SqliteStore(store_path)
    tasks = [Task(id=f"t{i}", input={"expression": f"{i}+1"}, answer=i + 1) for i in range(100)]
    store.add_tasks(tasks)
    for start in range(0, n, 1000):
        store.enqueue([tasks[i % 100].id for i in range(start, min(n, start + 1000))], "soak")
    store.close()


def start_server(model: Path, store: Path, port: int, memory: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, __file__, "--serve", "--model", str(model), "--store", str(store)]
    cmd += ["--port", str(port), "--gateway-memory", str(memory)]
    proc = subprocess.Popen(cmd, start_new_session=True)
    for _ in range(600):
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
            return proc
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError("the serving process did not start")


def heap_snapshot(proc: subprocess.Popen[bytes], prefix: str, n: int) -> None:
    """Ask the serving process for heap snapshot n and wait until it is written."""
    proc.send_signal(signal.SIGUSR1)
    for _ in range(1200):
        if Path(f"{prefix}.{n}.txt").exists():
            return
        time.sleep(0.1)


def start_runner(port: int, concurrency: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "tracerl.cli", "runner", f"{ROOT}/bench/soak.py:agent",
        "--url", f"http://127.0.0.1:{port}", "--runner.concurrency", str(concurrency),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL)


def sample(db: sqlite3.Connection, store: Path, procs: dict) -> dict:
    """One sample: finished rollouts, spans, store bytes and every process's RSS (MB)."""
    import psutil

    done = db.execute("SELECT COUNT(*) FROM rollouts WHERE status != 'queued' AND status != "
                      "'running'").fetchone()[0]  # fmt: skip
    spans = db.execute("SELECT MAX(rowid) FROM spans").fetchone()[0] or 0
    size = sum(p.stat().st_size for p in (store, Path(f"{store}-wal")) if p.exists())
    rss = {}
    for name, proc in procs.items():
        try:
            rss[name] = psutil.Process(proc.pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            rss[name] = float("nan")
    return {"t": time.time(), "done": done, "spans": spans, "bytes": size, "rss": rss}


def latencies(store: Path) -> list[float]:
    """Claim -> finish seconds of every finished rollout, in finishing order."""
    db = sqlite3.connect(store)
    rows = db.execute(
        "SELECT finished_at - started_at FROM rollouts WHERE finished_at IS NOT NULL "
        "ORDER BY finished_at"
    ).fetchall()
    db.close()
    return [r[0] for r in rows]


def p99_per_k(lat: list[float], k: int = 1000) -> list[float]:
    """p99 latency (ms) of each consecutive block of k finished rollouts."""
    blocks = [lat[i : i + k] for i in range(0, len(lat), k) if len(lat[i : i + k]) >= k // 2]
    return [float(np.percentile(b, 99) * 1000) for b in blocks]


def growth(samples: list[dict], warm: int) -> dict[str, float]:
    """Each process's last live RSS minus its RSS after `warm` rollouts (MB). A runner
    that exits once the queue is empty reads 0 (or NaN) after it; its last live sample
    counts."""
    base = next((s for s in samples if s["done"] >= warm), samples[0])
    out = {}
    for name, start in base["rss"].items():
        live = [s["rss"][name] for s in samples if s["rss"][name] > 0]  # NaN > 0 is False
        out[name] = round(live[-1] - start, 1) if live else float("nan")
    return out


def plot(samples: list[dict], p99: list[float], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    done = [s["done"] for s in samples]
    for name in samples[0]["rss"]:
        ax[0].plot(done, [s["rss"][name] for s in samples], label=name)
    ax[0].set(xlabel="rollouts finished", ylabel="RSS (MB)", title="memory per process")
    ax[0].legend()
    ax[1].plot([(i + 1) * 1000 for i in range(len(p99))], p99, marker="o")
    ax[1].set(xlabel="rollouts finished", ylabel="p99 claim->finish (ms)", title="latency")
    ax[2].plot([s["spans"] for s in samples], [s["bytes"] / 1e6 for s in samples])
    ax[2].set(xlabel="spans", ylabel="store file + WAL (MB)", title="store size")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def soak(args: argparse.Namespace, tmp: Path) -> dict:
    model, store = tmp / "model", tmp / "traces.db"
    build_model(model)
    queue_rollouts(store, args.rollouts)
    procs = {"serve": start_server(model, store, args.port, args.gateway_memory)}
    try:
        for i in range(args.runners):
            procs[f"runner{i}"] = start_runner(args.port, args.concurrency)
        db = sqlite3.connect(store)
        samples, t0 = [sample(db, store, procs)], time.time()
        marks = [args.warmup, (args.warmup + args.rollouts) // 2, args.rollouts]
        while samples[-1]["done"] < args.rollouts:
            time.sleep(1.0)
            now = sample(db, store, procs)
            if (
                now["done"] - samples[-1]["done"] >= args.sample_every
                or now["done"] >= args.rollouts
            ):
                samples.append(now)
                while marks and now["done"] >= marks[0]:
                    marks.pop(0)
                    if os.environ.get(TRACEMALLOC_ENV):
                        heap_snapshot(procs["serve"], os.environ[TRACEMALLOC_ENV], 2 - len(marks))
                print(
                    f"{now['done']:>6} rollouts {now['t'] - t0:6.0f}s rss {now['rss']}", flush=True
                )
            if any(p.poll() is not None for k, p in procs.items() if k == "serve"):
                raise RuntimeError("the serving process died")
        db.close()
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    return report(args, samples, latencies(store), time.time() - t0, tmp)


def report(args: argparse.Namespace, samples: list[dict], lat: list[float], wall: float,
           tmp: Path) -> dict:  # fmt: skip
    p99 = p99_per_k(lat)
    plot(samples, p99, Path(args.out))
    last = samples[-1]
    return {
        "rollouts": last["done"],
        "wall_s": round(wall, 1),
        "rollouts_per_s": round(last["done"] / wall, 1),
        "rss_growth_mb": growth(samples, args.warmup),
        "rss_mb_end": {k: round(v, 1) for k, v in last["rss"].items()},
        "p99_ms_first": round(p99[0], 1) if p99 else None,
        "p99_ms_last": round(p99[-1], 1) if p99 else None,
        "p99_ms_per_1000": [round(p, 1) for p in p99],
        "spans": last["spans"],
        "bytes_per_span": round(last["bytes"] / max(1, last["spans"])),
        "png": str(args.out),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--runners", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8, help="agents per runner")
    parser.add_argument("--sample-every", type=int, default=250)
    parser.add_argument("--warmup", type=int, default=1000, help="rollouts before the baseline")
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--out", default="soak.png")
    parser.add_argument(
        "--gateway-memory", type=int, default=100_000,
        help="rollouts whose conversations the gateway remembers (Gateway(memory=...))",
    )  # fmt: skip
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.model, args.store, args.port, args.gateway_memory)
        return
    with tempfile.TemporaryDirectory() as tmp:
        result = soak(args, Path(tmp))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
