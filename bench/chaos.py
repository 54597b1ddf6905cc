"""Chaos: kill -9 each kind of tracerl process at random points; prove nothing is lost.

The process kinds that are separate today, each killed `--kills` times in turn:

- train: a whole `tracerl train` process (trainer + engine + gateway + store + runners),
  then `tracerl train --resume`. Checked against its ledger: no rollout trained twice, and
  every finished training rollout with an outcome trained (a sync run ends with no group
  pending).
- runner: a `tracerl runner` serving a `tracerl serve` store; a new runner is started.
  The dead one's leases expire and its rollouts are re-run.
- serve: the `tracerl serve` process, restarted on the same SQLite file and port. Runners
  that died with it (a claim that cannot reach the store ends a runner today) are restarted
  and counted.

For the serve/runner kinds: lost = rollouts not finished at the end, or finished before a
kill and changed after it; twice = a rollout finished at a kill whose attempt or finish time
later changed (it ran again after being committed). `error_failed` counts rollouts finished
as failed because a model call could not reach the gateway: an outage recorded as an
agent's failure. Every store must pass `PRAGMA integrity_check`.

Prints a table per kind; the last line is JSON.

    nice .venv/bin/python bench/chaos.py [--kills 7 --seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict

ROOT = Path(__file__).resolve().parents[1]
AGENT = f"{ROOT}/bench/chaos.py:agent"
REWARD = f"{ROOT}/examples/calculator/reward.py:reward"


def agent(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    """Two model calls with a pause between them, long enough to be killed in."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list = [{"role": "user", "content": task["question"]}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=16)
    time.sleep(float(os.environ.get("CHAOS_AGENT_SLEEP", "0.3")))
    messages += [reply.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": "c", "content": "85"}]
    final = client.chat.completions.create(model=model, messages=messages, max_tokens=16)
    return final.choices[0].message.content or ""


class KindReport(BaseModel):
    """What the kills of one process kind did."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    kind: str
    """Which process was killed: train, runner or serve."""
    kills: int = 0
    """SIGKILLs delivered while it ran."""
    resumed_ok: int = 0
    """Restarts after which the job went on and finished."""
    lost: int = 0
    """Finished rollouts neither trained nor pending (train), or not finished / changed."""
    twice: int = 0
    """Rollouts trained twice (ledger), or run again after they were committed."""
    integrity_ok: bool = False
    """The store file passed PRAGMA integrity_check at the end."""
    runner_restarts: int = 0
    """Runners that died with the serving process and were started again."""
    error_failed: int = 0
    """Rollouts recorded as failed because the gateway could not be reached."""


def tiny_model(out: Path) -> Path:
    """A random-init tiny model whose tokenizer knows the calculator conversations."""
    from tracerl.examples import example_module
    from tracerl.models.template import render_chat
    from tracerl.models.tiny import TinyModelConfig, build_tiny_model

    demos = example_module("calculator", "expert").demonstrations(300, seed=7)
    texts = [render_chat(d["messages"], d["tools"]) for d in demos]
    return build_tiny_model(out, texts, TinyModelConfig(hidden_size=64, num_layers=2, seed=0))


def task_file(tmp: Path, n_train: int) -> Path:
    from tracerl.examples import example_module

    make = example_module("calculator", "tasks").make_tasks
    path = tmp / "tasks.jsonl"
    rows = make(n_train, "train", 0) + make(8, "eval", 1)
    path.write_text("".join(json.dumps(t) + "\n" for t in rows))
    return path


def spawn(args: list[str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    """A `tracerl` command in its own process group, its output appended to `log`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = log.open("ab")
    cmd = [sys.executable, "-m", "tracerl.cli", *args]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=out, start_new_session=True)


def kill9(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process's whole group (its own session), then reap it."""
    with contextlib.suppress(ProcessLookupError):  # it ended by itself
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def integrity_ok(path: Path) -> bool:
    db = sqlite3.connect(path)
    try:
        return db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        db.close()


def wait_for(cond, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> bool:
    """Poll `cond` until true; False on timeout or when `proc` ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(0.1)
    return False


# ---------------------------------------------------------------- train (then --resume)


def chaos_train(tmp: Path, model: Path, kills: int, rng: random.Random) -> KindReport:
    """Kill `tracerl train` `kills` times at random points, resume each time."""
    from tracerl.pipeline.checkpoints import read_ledger

    rep, steps, run = KindReport(kind="train"), 2 + kills, tmp / "runs" / "chaos"
    flags = [
        "--name", "chaos", "--model", str(model), "--tasks", str(task_file(tmp, 4 * steps)),
        "--agent", AGENT, "--reward", REWARD, "--pipeline.steps", str(steps),
        "--pipeline.tasks_per_step", "4", "--pipeline.group_size", "2",
        "--pipeline.eval_every", "0", "--no-eval_before", "--runner.lease_s", "2",
        "--no-guard.preflight",
    ]  # fmt: skip
    proc = spawn(["train", *flags], tmp, tmp / "train.log")
    for _ in range(kills):
        # A random point once the run has a store: mid-step, mid-checkpoint, or mid-publish.
        wait_for(lambda: (run / "traces.db").exists(), 180, proc)
        time.sleep(rng.uniform(0.5, 6.0))
        if proc.poll() is None:
            kill9(proc)
            rep.kills += 1
        proc = spawn(["train", "--resume", str(run)], tmp, tmp / "train.log")
    finished = proc.wait(timeout=600) == 0 and (run / "summary.json").exists()
    rep.resumed_ok = rep.kills if finished else 0
    trained = read_ledger(run)
    rep.twice = len(trained) - len(set(trained))
    db = sqlite3.connect(run / "traces.db")
    done = {r[0] for r in db.execute(
        "SELECT id FROM rollouts WHERE group_id LIKE 'chaos/step%' "
        "AND status IN ('succeeded', 'failed')")}  # fmt: skip
    db.close()
    rep.lost = len(done - set(trained)) if finished else len(done)
    rep.integrity_ok = integrity_ok(run / "traces.db")
    return rep


# ---------------------------------------------------------------- serve + runner pairs


class Service:
    """A `tracerl serve` on a SQLite file with queued rollouts, and its runners."""

    def __init__(self, tmp: Path, model: Path, rollouts: int) -> None:
        self.tmp, self.model, self.store = tmp, model, tmp / "serve.db"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._queue(rollouts)
        self.serve = self.start_serve()
        self.runners = [self.start_runner(), self.start_runner()]

    def _queue(self, n: int) -> None:
        from tracerl.store.sqlite import SqliteStore
        from tracerl.types import Task

        rows = [json.loads(line) for line in task_file(self.tmp, n).read_text().splitlines()]
        tasks = [Task.model_validate(t) for t in rows if t["split"] == "train"]
        store = SqliteStore(self.store)
        store.add_tasks(tasks)
        # Attempts enough for every kill: a rollout re-run after each is not a lost one.
        store.enqueue([t.id for t in tasks], "chaos", max_attempts=50)
        store.close()

    def start_serve(self) -> subprocess.Popen[bytes]:
        args = ["serve", "--model", str(self.model), "--store", str(self.store),
                "--port", str(self.port)]  # fmt: skip
        proc = spawn(args, self.tmp, self.tmp / "serve.log")
        up = wait_for(self._healthy, 180, proc)
        assert up, f"tracerl serve did not start: see {self.tmp / 'serve.log'}"
        return proc

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def start_runner(self) -> subprocess.Popen[bytes]:
        args = ["runner", AGENT, "--url", self.url, "--reward", REWARD,
                "--runner.lease_s", "2", "--runner.concurrency", "4"]  # fmt: skip
        return spawn(args, self.tmp, self.tmp / "runner.log")

    def finished(self) -> dict[str, tuple[int, float]]:
        """Finished rollouts now: id -> (attempt, finished_at)."""
        db = sqlite3.connect(self.store, timeout=30)
        rows = db.execute(
            "SELECT id, attempt, finished_at FROM rollouts WHERE finished_at IS NOT NULL"
        ).fetchall()
        db.close()
        return {r[0]: (r[1], r[2]) for r in rows}

    def close(self) -> None:
        for proc in [self.serve, *self.runners]:
            kill9(proc)


def chaos_service(tmp: Path, model: Path, kind: str, kills: int, rng: random.Random) -> KindReport:
    """Kill a runner, or the serving process, `kills` times; check the store at the end."""
    rep = KindReport(kind=kind)
    svc = Service(tmp, model, rollouts=12 * kills)
    seen: dict[str, tuple[int, float]] = {}
    try:
        for _ in range(kills):
            time.sleep(rng.uniform(1.0, 5.0))
            seen.update(svc.finished())
            if kind == "runner":
                victim = rng.randrange(len(svc.runners))
                if svc.runners[victim].poll() is None:
                    kill9(svc.runners[victim])
                    rep.kills += 1
                svc.runners[victim] = svc.start_runner()
            else:
                kill9(svc.serve)
                rep.kills += 1
                svc.serve = svc.start_serve()
                rep.runner_restarts += _restart_dead(svc)
        rep.resumed_ok = rep.kills if _drain(svc, rep) else 0
        _tally(svc, seen, rep)
    finally:
        svc.close()
    rep.integrity_ok = integrity_ok(svc.store)
    return rep


def _restart_dead(svc: Service) -> int:
    """Start a new runner for each that has exited while work remains; how many."""
    time.sleep(1.0)  # a runner that lost the store mid-claim needs a moment to die
    dead = [i for i, p in enumerate(svc.runners) if p.poll() is not None]
    for i in dead:
        svc.runners[i] = svc.start_runner()
    return len(dead)


def _drain(svc: Service, rep: KindReport) -> bool:
    """Wait for every rollout to finish, restarting runners that die; whether it did."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        db = sqlite3.connect(svc.store, timeout=30)
        open_ = db.execute("SELECT COUNT(*) FROM rollouts WHERE finished_at IS NULL").fetchone()
        db.close()
        if open_[0] == 0:
            return True
        if all(p.poll() is not None for p in svc.runners):
            rep.runner_restarts += _restart_dead(svc)
        time.sleep(0.5)
    return False


def _tally(svc: Service, seen: dict[str, tuple[int, float]], rep: KindReport) -> None:
    """lost / twice / error_failed from what was finished at the kills and at the end."""
    end = svc.finished()
    db = sqlite3.connect(svc.store, timeout=30)
    total = db.execute("SELECT COUNT(*) FROM rollouts").fetchone()[0]
    rep.error_failed = db.execute(
        "SELECT COUNT(*) FROM rollouts WHERE status = 'failed' AND "
        "(error LIKE '%Connection%' OR error LIKE '%connect%')"
    ).fetchone()[0]
    db.close()
    rep.lost = total - len(end) + sum(1 for i in seen if i not in end)
    rep.twice = sum(1 for i, v in seen.items() if i in end and end[i] != v)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- report


def table(reports: list[KindReport]) -> str:
    head = f"{'kind':<8}{'kills':>6}{'resumed':>9}{'lost':>6}{'twice':>7}{'integrity':>11}"
    head += f"{'runner restarts':>17}{'error-failed':>14}"
    lines = [head]
    for r in reports:
        lines.append(
            f"{r.kind:<8}{r.kills:>6}{r.resumed_ok:>9}{r.lost:>6}{r.twice:>7}"
            f"{'ok' if r.integrity_ok else 'BAD':>11}{r.runner_restarts:>17}{r.error_failed:>14}"
        )
    return "\n".join(lines)


def run(kills: int, seed: int, kinds: list[str], tmp: Path) -> dict:
    """Every kind in turn; the summary the last line prints."""
    rng = random.Random(seed)
    model = tiny_model(tmp / "model")
    reports = []
    for kind in kinds:
        where = tmp / kind
        where.mkdir()
        if kind == "train":
            reports.append(chaos_train(where, model, kills, rng))
        else:
            reports.append(chaos_service(where, model, kind, kills, rng))
        print(table(reports[-1:]).splitlines()[-1], flush=True)
    print(table(reports))
    return {
        "kills": sum(r.kills for r in reports),
        "resumed_ok": sum(r.resumed_ok for r in reports),
        "lost": sum(r.lost for r in reports),
        "twice": sum(r.twice for r in reports),
        "integrity_ok": all(r.integrity_ok for r in reports),
        "kinds": {r.kind: r.model_dump(exclude={"kind"}) for r in reports},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=7, help="kills of each process kind")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default="train,runner,serve")
    parser.add_argument("--keep", help="keep the stores and logs in this folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(args.keep) if args.keep else Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        print(json.dumps(run(args.kills, args.seed, args.kinds.split(","), where)))


if __name__ == "__main__":
    main()
