"""The dashboard on a big run: page load time and live-update latency.

Builds a synthetic run (config.json, metrics.jsonl, trained.jsonl and a traces.db of
--rollouts rollouts with 1-3 model calls each, sub-agent calls nested under their parent,
written with the store's own codecs), serves `tracerl dashboard` over it, and measures
with the system chromium (Playwright):
- load: navigation until the charts, the health panel and the first rollouts page show;
- update: a metrics line appended to metrics.jsonl until the reward chart shows its step;
- the API's own latency for the table's pages and filters, and for one trace view.
Goals: load < 1 s, update < 2 s. The last line printed is one JSON object.

    .venv/bin/python bench/dashboard.py [--rollouts 10000 --updates 5]
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tracerl.dashboard.app import create_app
from tracerl.pipeline.config import PipelineConfig, TrainConfig
from tracerl.server import serve_in_thread
from tracerl.store.schema import INSERT_REWARD, INSERT_ROLLOUT, INSERT_SPAN, ROLLOUT_COLS, span_row
from tracerl.store.sqlite import SqliteStore
from tracerl.types import PolicyVersion, Reward, Rollout, RolloutStatus, Span, Task

CHROMIUM = "/usr/bin/chromium"
"""The system chromium (Debian's package); Playwright never downloads a browser here."""
GROUP, PER_STEP = 8, 16
"""Rollouts per group and groups per step of the synthetic run."""


def _ids(encode: object, text: str) -> list[int]:
    if encode is None:
        return [random.randrange(5, 500) for _ in range(max(1, len(text) // 3))]
    return encode(text).ids  # type: ignore[operator]


def _spans(r: Rollout, question: str, encode: object, version: int) -> list[Span]:
    """1-3 calls: a tool call, an answer, and now and then a sub-agent's call under the
    first (role 'checker')."""
    msgs: list[dict] = [{"role": "user", "content": question}]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "37+48"}}</tool_call>'
    out = []
    for seq, (role, text) in enumerate(
        [("policy", call), ("policy", "85"), ("checker", "looks right")][: random.randint(1, 3)]
    ):
        ids = _ids(encode, text)
        parent = out[0].id if role == "checker" else None
        out.append(Span(
            id=f"{r.id}-{seq}", rollout_id=r.id, attempt=r.attempt, seq=seq, role=role,
            policy_version=version, prompt_ids=_ids(encode, json.dumps(msgs)), completion_ids=ids,
            logprobs=[-random.random() ** 3 * 4 for _ in ids], messages=list(msgs),
            response={"content": text}, parent_span_id=parent, latency_s=0.01,
        ))  # fmt: skip
        msgs = [*msgs, {"role": "assistant", "content": text}]
        if seq == 0:
            msgs.append({"role": "tool", "content": "85"})
    return out


def _rollout(name: str, k: int, step: int, task: Task, live: bool) -> Rollout:
    """The k-th rollout: finished (succeeded/failed with a reward), or queued/running at the
    live end of the run."""
    gid = f"{name}/step{step}/{(k // GROUP) % PER_STEP}-{task.id}"
    now = time.time()
    if live:
        status = random.choice([RolloutStatus.queued, RolloutStatus.running])
        running = status is RolloutStatus.running
        return Rollout(
            id=f"r{k:06d}", task_id=task.id, status=status, attempt=int(running), group_id=gid,
            runner_id="bench" if running else None, created_at=now,
            lease_expires_at=now + random.uniform(-5, 60) if running else None,
        )  # fmt: skip
    reward = float(random.random() < 0.3 + 0.6 * step / 80)
    status = RolloutStatus.succeeded if random.random() > 0.02 else RolloutStatus.failed
    return Rollout(
        id=f"r{k:06d}", task_id=task.id, status=status, attempt=1, group_id=gid,
        created_at=now, finished_at=now, answer="85" if reward else "37+48", reward=reward,
    )  # fmt: skip


def synthetic_run(root: Path, name: str, rollouts: int, model: str = "") -> Path:
    """runs/<name>/ with `rollouts` rollouts in traces.db, their metrics and ledger; token
    ids come from `model`'s tokenizer when given (so the trace view decodes them)."""
    random.seed(0)
    run = root / name
    run.mkdir(parents=True, exist_ok=True)
    steps = max(1, rollouts // (GROUP * PER_STEP))
    cfg = TrainConfig(name=name, runs=str(root), model=model,
                      pipeline=PipelineConfig(steps=steps, group_size=GROUP, tasks_per_step=PER_STEP))  # fmt: skip
    (run / "config.json").write_text(cfg.model_dump_json(indent=2))
    encode = None
    if model:
        from tokenizers import Tokenizer

        encode = Tokenizer.from_file(str(Path(model) / "tokenizer.json")).encode
    store = SqliteStore(run / "traces.db")  # the schema, as a run creates it
    tasks = [
        Task(id=f"t{i}", input={"question": f"What is {i}+48?"}, answer=i + 48) for i in range(500)
    ]
    store.add_tasks(tasks)
    for v in range(steps + 1):
        store.publish_version(PolicyVersion(version=v, path="", role="policy"))
    store.close()
    rows, spans, rewards, ledger = [], [], [], {}
    for k in range(rollouts):
        step = k // (GROUP * PER_STEP)
        task = tasks[(k // GROUP) % len(tasks)]
        r = _rollout(name, k, step, task, live=k >= rollouts - GROUP * 4)
        rows.append([getattr(r, c) for c in ROLLOUT_COLS])
        if r.status in (RolloutStatus.succeeded, RolloutStatus.failed):
            spans += [span_row(s) for s in _spans(r, task.input["question"], encode, step)]
            w = Reward(rollout_id=r.id, attempt=1, value=r.reward or 0.0)
            rewards.append([getattr(w, c) for c in Reward.model_fields])
            ledger.setdefault(step + 1, []).append(r.id)
    db = sqlite3.connect(run / "traces.db")
    with db:
        db.executemany(INSERT_ROLLOUT, rows)
        db.executemany(INSERT_SPAN, spans)
        db.executemany(INSERT_REWARD, rewards)
    db.close()
    (run / "trained.jsonl").write_text(
        "".join(json.dumps({"step": s, "rollouts": ids}) + "\n" for s, ids in ledger.items())
    )
    with (run / "metrics.jsonl").open("w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps(metrics_line(s)) + "\n")
    return run


def metrics_line(step: int) -> dict[str, float | int]:
    """One plausible step of metrics."""
    return {
        "step": step, "train/reward": min(1.0, 0.3 + step / 100 + random.uniform(-0.05, 0.05)),
        "pipeline/staleness_mean": random.uniform(0, 2), "pipeline/rollouts_per_s": random.uniform(20, 40),
        "time/trainer_idle_s": random.uniform(0, 3), "runner/utilisation": random.uniform(0.6, 1),
        "train/lr": 1e-4, "train/tokens_per_s": random.uniform(1500, 3000),
        **({"eval/success": min(1.0, 0.3 + step / 90)} if step % 5 == 0 else {}),
    }  # fmt: skip


def api_ms(url: str, run: str, reps: int = 5) -> dict[str, float]:
    """Median latency (ms) of the table's queries and one trace view."""
    paths = {
        "page": "rollouts?limit=50", "deep_page": "rollouts?limit=50&offset=9000",
        "status_filter": "rollouts?status=failed", "version_filter": "rollouts?version=40",
        "role_filter": "rollouts?role=checker", "search": "rollouts?q=r0099",
        "step_filter": "rollouts?step=30", "health": "health", "metrics": "metrics",
        "trace": "rollouts/r000123",
    }  # fmt: skip
    out = {}
    with httpx.Client(base_url=f"{url}/api/runs/{run}/", timeout=30) as client:
        for name, path in paths.items():
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                client.get(path).raise_for_status()
                times.append((time.perf_counter() - t0) * 1000)
            out[name] = round(statistics.median(times), 1)
    return out


READY = """() => document.body.dataset.ready === '1'
  && document.querySelectorAll('#rollouts tbody tr').length > 0
  && +document.querySelector('#chart-train-reward').dataset.points > 0
  && document.querySelector('#health').children.length > 0"""


def _load(browser: Any, url: str) -> tuple[Any, float]:
    """A new page (its own context: nothing cached) loaded until READY; (page, seconds)."""
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    t0 = time.perf_counter()
    page.goto(url)
    page.wait_for_function(READY, timeout=30_000)
    return page, time.perf_counter() - t0


def measure_page(url: str, run: Path, updates: int) -> tuple[list[float], list[float]]:
    """(load times, update latencies) in seconds, in one chromium. Each load is a new
    visitor (a fresh context, no cache); the first also starts the browser's renderer and
    warms the server up."""
    from playwright.sync_api import sync_playwright

    loads, lags = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        for _ in range(4):
            page, seconds = _load(browser, f"{url}/?run={run.name}")
            loads.append(seconds)
        last = max(
            json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
        )
        for i in range(updates):
            time.sleep(random.uniform(0.2, 1.0))  # at a random phase of the page's poll
            step = last + 1 + i
            with (run / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(metrics_line(step)) + "\n")
            t0 = time.perf_counter()
            page.wait_for_function(
                f"() => document.querySelector('#chart-train-reward').dataset.lastStep === '{step}'",
                timeout=30_000, polling=20,
            )  # fmt: skip
            lags.append(time.perf_counter() - t0)
        browser.close()
    return loads, lags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--model", default="", help="model dir whose tokenizer encodes tokens")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run = synthetic_run(Path(tmp) / "runs", "bench", args.rollouts, args.model)
        print(f"synthetic run: {args.rollouts} rollouts in {time.perf_counter() - t0:.1f} s")
        server = serve_in_thread(create_app(Path(tmp) / "runs"))
        try:
            api = api_ms(server.url, "bench")
            print("API median ms:", api)
            loads, lags = measure_page(server.url, run, args.updates)
        finally:
            server.stop()
    load, lag_med, lag_max = statistics.median(loads[1:]), statistics.median(lags), max(lags)
    print(f"page load: {[round(x, 3) for x in loads]} s (median after the first: {load:.3f} s)")
    print(f"live update: {[round(x, 3) for x in lags]} s (median {lag_med:.3f}, max {lag_max:.3f})")
    print(json.dumps({
        "rollouts": args.rollouts, "load_s": round(load, 3), "first_load_s": round(loads[0], 3),
        "update_s_median": round(lag_med, 3), "update_s_max": round(lag_max, 3), "api_ms": api,
        "goals": {"load_s": 1.0, "update_s": 2.0}, "ok": load < 1.0 and lag_max < 2.0,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
