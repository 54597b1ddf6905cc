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
- engine, engine1: an engine server process of a `tracerl train` whose policy is served by
  `engine.kind = "hf_server"` servers (2 replicas, or 1 for engine1). Nothing here restarts
  it: the run's own launcher notices the exit, starts a fresh server and loads the current
  weights into it (tracerl.engines.launch). Checked as the train kind is, plus the engine
  restarts seen (the recoveries the run logs) and the rollouts failed because a
  call found no replica in service (a 503 `engine_unavailable` from the gateway, which the
  agent here does not retry): with 2 replicas a call on the killed one is retried on the
  other; with 1 a call during the restart has nowhere to go.

For the serve/runner kinds: lost = rollouts not finished at the end, or finished before a
kill and changed after it; twice = a rollout finished at a kill whose attempt or finish time
later changed (it ran again after being committed). `error_failed` counts rollouts finished
as failed because a model call could not reach the gateway: an outage recorded as an
agent's failure. Every store must pass `PRAGMA integrity_check`.

Prints a table per kind; the last line is JSON.

    nice .venv/bin/python bench/chaos.py [--kills 7 --seed 0 --kinds train,engine]
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
    """Which process was killed: train, runner, serve, engine or engine1."""
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
    """Rollouts recorded as failed because the gateway (or, for the engine kinds, any engine
    replica) could not be reached."""
    engine_restarts: int = 0
    """Engine replicas the run restarted and brought back with the current weights."""


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
    rep, steps, run = KindReport(kind="train"), 2 + kills, tmp / "runs" / "chaos"
    proc = spawn(["train", *train_flags(tmp, model, steps)], tmp, tmp / "train.log")
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
    check_ledger(run, finished, rep)
    return rep


def train_flags(tmp: Path, model: Path, steps: int) -> list[str]:
    """A small synchronous `tracerl train` run named chaos, on the calculator tasks."""
    return [
        "--name", "chaos", "--model", str(model), "--tasks", str(task_file(tmp, 4 * steps)),
        "--agent", AGENT, "--reward", REWARD, "--pipeline.steps", str(steps),
        "--pipeline.tasks_per_step", "4", "--pipeline.group_size", "2",
        "--pipeline.eval_every", "0", "--no-eval_before", "--runner.lease_s", "2",
        "--no-guard.preflight",
    ]  # fmt: skip


def check_ledger(run: Path, finished: bool, rep: KindReport) -> None:
    """twice / lost / integrity of a train run: no rollout in its ledger twice, and every
    finished training rollout with an outcome trained (a sync run ends with none pending)."""
    from tracerl.pipeline.checkpoints import read_ledger

    trained = read_ledger(run)
    rep.twice = len(trained) - len(set(trained))
    db = sqlite3.connect(run / "traces.db")
    done = {r[0] for r in db.execute(
        "SELECT id FROM rollouts WHERE group_id LIKE 'chaos/step%' "
        "AND status IN ('succeeded', 'failed')")}  # fmt: skip
    db.close()
    rep.lost = len(done - set(trained)) if finished else len(done)
    rep.integrity_ok = integrity_ok(run / "traces.db")


# ---------------------------------------------------------------- engine servers of a run


def chaos_engine(
    tmp: Path, model: Path, kills: int, rng: random.Random, replicas: int
) -> KindReport:
    """Kill an engine server of a running `tracerl train` `kills` times; the run restarts it."""
    kind = "engine" if replicas > 1 else "engine1"
    rep, run, logs = KindReport(kind=kind), tmp / "runs" / "chaos", tmp / "engine-logs"
    engine = ["--engine.kind", "hf_server", "--engine.replicas", str(replicas),
              "--engine.log_dir", str(logs)]  # fmt: skip
    # Steps enough to outlast the kills: each waits for the previous restart to finish.
    args = ["train", *train_flags(tmp, model, 6 * kills + 4), *engine]
    proc = spawn(args, tmp, tmp / "train.log")
    try:
        # Kills start once the run serves rollouts: a server that dies before the engine's
        # first answer fails the run's start (a model that cannot be served), by design.
        wait_for(lambda: _rollouts_finished(run) > 0, 300, proc)
        for _ in range(kills):
            if not wait_for(lambda: len(engine_servers(proc)) == replicas, 300, proc):
                break  # the run ended (or never got its servers up)
            time.sleep(rng.uniform(0.5, 4.0))
            live = engine_servers(proc)
            if not live or proc.poll() is not None:
                break
            victim = rng.choice(live)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(victim, signal.SIGKILL)  # the server and all it started
                rep.kills += 1
            # The next kill waits until the run has brought the replica back (it logs each
            # recovery), so every kill hits a serving server.
            wait_for(lambda n=rep.kills: _recoveries(tmp / "train.log") >= n, 180, proc)
        finished = proc.wait(timeout=600) == 0 and (run / "summary.json").exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pid in engine_servers(proc):  # servers orphaned by a run that died
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    rep.resumed_ok = rep.kills if finished else 0
    check_ledger(run, finished, rep)
    rep.engine_restarts = _recoveries(tmp / "train.log")
    db = sqlite3.connect(run / "traces.db")
    rep.error_failed = db.execute(
        "SELECT COUNT(*) FROM rollouts WHERE status = 'failed' AND "
        "(error LIKE '%engine_unavailable%' OR error LIKE '%replica%')"
    ).fetchone()[0]
    db.close()
    return rep


def _recoveries(log: Path) -> int:
    """Replicas the run brought back into service (RemoteEngine logs each)."""
    return log.read_text(errors="replace").count("is back at version")


def _rollouts_finished(run: Path) -> int:
    if not (run / "traces.db").exists():
        return 0
    db = sqlite3.connect(run / "traces.db", timeout=30)
    try:
        return db.execute("SELECT COUNT(*) FROM rollouts WHERE finished_at IS NOT NULL").fetchone()[
            0
        ]
    except sqlite3.OperationalError:  # the schema is not written yet
        return 0
    finally:
        db.close()


def engine_servers(proc: subprocess.Popen[bytes]) -> list[int]:
    """Pids of the live hf_server processes the run `proc` started (its children)."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children()
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE and "tracerl.engines.hf_server" in (
                " ".join(child.cmdline())
            ):
                found.append(child.pid)
    return found


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
    head += f"{'runner restarts':>17}{'error-failed':>14}{'engine restarts':>17}"
    lines = [head]
    for r in reports:
        lines.append(
            f"{r.kind:<8}{r.kills:>6}{r.resumed_ok:>9}{r.lost:>6}{r.twice:>7}"
            f"{'ok' if r.integrity_ok else 'BAD':>11}{r.runner_restarts:>17}{r.error_failed:>14}"
            f"{r.engine_restarts:>17}"
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
        elif kind in ("engine", "engine1"):
            replicas = 2 if kind == "engine" else 1
            reports.append(chaos_engine(where, model, kills, rng, replicas))
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
    parser.add_argument("--kinds", default="train,runner,serve,engine,engine1")
    parser.add_argument("--keep", help="keep the stores and logs in this folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(args.keep) if args.keep else Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        print(json.dumps(run(args.kills, args.seed, args.kinds.split(","), where)))


if __name__ == "__main__":
    main()
