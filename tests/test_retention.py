"""`tracerl traces prune`: old finished rollouts go with their spans and rewards, the file
shrinks, and nothing a run still needs (queued, running, unconsumed groups, the replay
buffer) is touched."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from tracerl.algorithms.replay import ReplayState
from tracerl.cli import main as cli
from tracerl.store.retention import integrity_ok, needed_by_run, prune
from tracerl.store.sqlite import SqliteStore
from tracerl.types import FinishedRollout, Rollout, RolloutStatus, Span, Task

DAY = 86400.0


def _span(r: Rollout, seq: int) -> Span:
    ids = np.random.default_rng(seq).integers(0, 50_000, 2000).tolist()
    return Span(
        id=f"{r.id}-{r.attempt}-{seq}", rollout_id=r.id, attempt=r.attempt, seq=seq,
        role="policy", policy_version=0, prompt_ids=ids, completion_ids=ids[:50],
        logprobs=[-0.5] * 50, messages=[{"role": "user", "content": "1+1"}],
        response={"content": "2"}, finish_reason="stop", temperature=1.0, prefix_reused=0,
    )  # fmt: skip


def _group(store: SqliteStore, gid: str, n: int, age_days: float) -> list[str]:
    """n finished rollouts of one group, two spans and a reward each, finished `age_days`
    ago."""
    store.enqueue(["t0"] * n, gid)
    done = []
    for r in store.claim("w", n=n):
        store.add_spans([_span(r, 0), _span(r, 1)])
        done.append(store.finish(r.id, r.attempt, RolloutStatus.succeeded, "2", 1.0).id)
    with store._tx() as db:  # backdate, as if they had finished then
        db.executemany(
            "UPDATE rollouts SET finished_at = ? WHERE id = ?",
            [(time.time() - age_days * DAY, i) for i in done],
        )
    return done


def _run_dir(tmp: Path, step: int, replayed: Rollout) -> Path:
    """A run named "r" whose latest checkpoint has done `step` steps and holds `replayed`
    in its replay buffer."""
    run = tmp / "runs" / "r"
    ckpt = run / "checkpoints" / f"step-{step}"
    ckpt.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"name": "r"}))
    replay = ReplayState(stored={"t0": [FinishedRollout(rollout=replayed)]})
    state = {"step": step, "curation": {"replay": replay.model_dump(mode="json")}}
    (ckpt / "pipeline.json").write_text(json.dumps(state))
    (run / "checkpoints" / "latest").write_text(ckpt.name)
    return run


def _store(tmp: Path) -> tuple[SqliteStore, dict[str, list[str]]]:
    store = SqliteStore(tmp / "traces.db")
    store.add_tasks([Task(id="t0", input={"q": "1+1"}, answer=2)])
    ids = {
        "old": _group(store, "eval", 20, age_days=30),
        "consumed": _group(store, "r/step0/0-t0", 4, age_days=30),
        "pending": _group(store, "r/step2/0-t0", 4, age_days=30),  # the run resumes at 2
        "new": _group(store, "eval2", 3, age_days=0),
    }
    later = [r.id for r in store.enqueue(["t0"] * 3, "later")]
    ids["running"] = [r.id for r in store.claim("w", n=2)]
    ids["queued"] = [i for i in later if i not in ids["running"]]
    return store, ids


def test_prune_keeps_what_runs_need_and_shrinks_the_file(tmp_path: Path) -> None:
    store, ids = _store(tmp_path)
    replayed = store.get_rollout(ids["consumed"][0])
    run = _run_dir(tmp_path, 2, replayed)
    needed = needed_by_run(store, run)
    assert needed == set(ids["pending"]) | {replayed.id}

    counts = prune(store, needed, time.time() - 7 * DAY)
    left = {r.id for r in store.rollouts()}
    kept = ids["pending"] + ids["new"] + ids["queued"] + ids["running"] + [replayed.id]
    assert left == set(kept)
    assert counts.rollouts == 20 + 3  # the old eval group and the consumed, unreplayed ones
    assert counts.spans == 2 * counts.rollouts and counts.rewards == counts.rollouts
    assert counts.bytes_after < counts.bytes_before * 0.6
    for i in ids["pending"] + [replayed.id]:  # what a resume reads is whole
        assert len(store.spans(i)) == 2 and len(store.rewards(i)) == 1
    with store._read() as db:
        orphans = db.execute(
            "SELECT COUNT(*) FROM spans WHERE rollout_id NOT IN (SELECT id FROM rollouts)"
        ).fetchone()[0]
    assert orphans == 0
    store.close()
    assert integrity_ok(tmp_path / "traces.db")


def test_prune_command_keep_n(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, ids = _store(tmp_path)
    store.close()
    out = Console(record=True, width=200)
    monkeypatch.setattr("tracerl.cli.console", out)
    cli(["traces", "prune", "--store", str(tmp_path / "traces.db"), "--keep", "3"])
    assert "pruned 28 rollouts, 56 spans" in out.export_text()
    store = SqliteStore(tmp_path / "traces.db")
    left = {r.id for r in store.rollouts()}
    assert left == set(ids["new"] + ids["queued"] + ids["running"])
    store.close()
    db = sqlite3.connect(tmp_path / "traces.db")
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
