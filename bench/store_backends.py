"""Claims per second of the two store back ends with several claiming processes at once.

Four processes (runners on other machines, as far as the store can tell) open the store and
loop until the queue is empty: claim one rollout, optionally record its spans, finish it.
On SQLite (one file, WAL) the claimers take turns on the file's write lock; on PostgreSQL
(a throwaway server on loopback, started as tests/pg.py does, or --postgres URL) claims take
rows `FOR UPDATE SKIP LOCKED` and run side by side. Wall time runs from the moment all
processes are ready to the last one's finish. The last line is one JSON object:
`store_claims_per_s_sqlite` and `store_claims_per_s_postgres` (claim + finish, no spans),
and `store_rollouts_per_s_*_spans` (claim + `turns` spans + finish).

    .venv/bin/python bench/store_backends.py [--rollouts 2000 --processes 4 ...]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.pg: the throwaway server

from tests import pg  # noqa: E402
from tracerl.store.open import open_store  # noqa: E402
from tracerl.types import RolloutStatus, Span, Task  # noqa: E402


class BenchConfig(BaseModel):
    """What to measure; every field is also a --flag."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    rollouts: int = 2000
    """Rollouts queued per measurement."""
    processes: int = 4
    """Concurrent claiming processes."""
    turns: int = 6
    """Spans per rollout in the with-spans measurement."""
    prompt_tokens: int = 300
    """Prompt length of every span."""
    completion_tokens: int = 50
    """Completion length of every span."""
    postgres: str = ""
    """An existing database to measure on (its tables must be empty); default: a throwaway
    server."""


def parse_args() -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, field in BenchConfig.model_fields.items():
        kind = str if name == "postgres" else int
        parser.add_argument(f"--{name}", type=kind, default=field.default)
    return BenchConfig(**vars(parser.parse_args()))


def spans_of(rollout_id: str, attempt: int, cfg: BenchConfig) -> list[Span]:
    """`turns` spans with `prompt_tokens` + `completion_tokens` token ids each."""
    prompt, completion = list(range(cfg.prompt_tokens)), list(range(cfg.completion_tokens))
    return [
        Span(id=f"{rollout_id}-{attempt}-{seq}", rollout_id=rollout_id, attempt=attempt,
             seq=seq, role="policy", policy_version=0, prompt_ids=prompt,
             completion_ids=completion, logprobs=[-0.5] * cfg.completion_tokens,
             messages=[{"role": "user", "content": "What is 17 * 23?"}],
             response={"content": "391"})
        for seq in range(cfg.turns)
    ]  # fmt: skip


def claimer(target: str, k: int, turns: int, cfg: BenchConfig, ready: Any, out: Any) -> None:
    """Child process: claim, (record spans,) finish until the queue is empty; reports when
    it started, when it ended, and how many it took."""
    store = open_store(target)
    ready.wait()
    t0, n = time.time(), 0
    while batch := store.claim(f"runner-{k}", n=1, lease_s=60):
        (r,) = batch
        if turns:
            store.add_spans(spans_of(r.id, r.attempt, cfg.model_copy(update={"turns": turns})))
        store.finish(r.id, r.attempt, RolloutStatus.succeeded, answer="391", reward=1.0)
        n += 1
    out.put((t0, time.time(), n))
    store.close()


def measure(target: str, cfg: BenchConfig, turns: int) -> float:
    """Rollouts per second through claim (+ spans) + finish with cfg.processes claimers."""
    store = open_store(target)
    store.add_tasks([Task(id=f"t{i}", input={"question": f"{i}*3"}) for i in range(100)])
    store.enqueue([f"t{i % 100}" for i in range(cfg.rollouts)])
    ctx = mp.get_context("spawn")
    ready, out = ctx.Barrier(cfg.processes), ctx.Queue()
    procs = [
        ctx.Process(target=claimer, args=(target, k, turns, cfg, ready, out))
        for k in range(cfg.processes)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    counts = store.counts()
    store.close()
    assert sum(n for _, _, n in results) == counts["succeeded"] == cfg.rollouts, counts
    wall = max(end for _, end, _ in results) - min(start for start, _, _ in results)
    return round(cfg.rollouts / wall, 1)


@contextmanager
def postgres_databases(cfg: BenchConfig) -> Iterator[list[str]]:
    """Two empty databases (one per measurement) on a throwaway server, or --postgres."""
    if cfg.postgres:
        yield [cfg.postgres]
        return
    bindir = pg.find_bin()
    if bindir is None:
        raise SystemExit("PostgreSQL binaries not found; pass --postgres URL")
    root = Path(tempfile.mkdtemp(prefix="tracerl-bench-pg-"))
    server = pg.start(root, bindir)
    try:
        yield [pg.create_database(server), pg.create_database(server)]
    finally:
        pg.stop(root, bindir)


def main() -> None:
    cfg = parse_args()
    # What each pass counts: bare claims, then whole rollouts with their spans.
    passes = [(0, "store_claims_per_s_{}"), (cfg.turns, "store_rollouts_per_s_{}_spans")]
    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp, postgres_databases(cfg) as urls:
        for (turns, key), url in zip(passes, urls, strict=False):  # a given database: 1 pass
            sqlite = str(Path(tmp) / f"store{turns}.db")
            result[key.format("sqlite")] = measure(sqlite, cfg, turns)
            result[key.format("postgres")] = measure(url, cfg, turns)
    print(
        f"{cfg.processes} processes, {cfg.rollouts} rollouts: claim+finish "
        f"{result['store_claims_per_s_sqlite']}/s on SQLite, "
        f"{result['store_claims_per_s_postgres']}/s on PostgreSQL"
    )
    print(orjson.dumps(result | cfg.model_dump(exclude={"postgres"})).decode())


if __name__ == "__main__":
    main()
