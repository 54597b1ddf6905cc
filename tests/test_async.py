"""Rollout sources: the asynchronous windowed FIFO, the staleness bound, dynamic sampling's
top-up, and the source state a checkpoint keeps."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tracerl.agents import python_agent
from tracerl.algorithms.config import CurationConfig
from tracerl.algorithms.curation import Curation
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.pipeline.async_source import AsyncSource
from tracerl.pipeline.sources import Agents, NoBatch, SourceState, SyncSource, TaskOrder
from tracerl.runner import Runner, RunnerConfig
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store.sqlite import SqliteStore
from tracerl.types import Task

from .scripted import ScriptedEngine

SLOW: dict[str, float] = {}
"""Task id -> seconds its agent sleeps between the two calls (the long tail)."""
CLIENT = httpx.Client()


def agent(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    """Two calls like the calculator agent; right or wrong by a hash of the rollout."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=CLIENT)
    messages: list = [{"role": "user", "content": task["question"]}]
    reply = client.chat.completions.create(model=model, messages=messages)
    time.sleep(SLOW.get(task["id"], 0.0))
    messages += [reply.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": "c", "content": "85"}]
    final = client.chat.completions.create(model=model, messages=messages)
    if task.get("coin") and not _coin(task["id"]):
        return "wrong"
    return final.choices[0].message.content or ""


COIN = Counter[str]()
COIN_LOCK = threading.Lock()


def _coin(task_id: str) -> bool:
    """Coin tasks: odd ids always lose (a group without signal); even ids alternate
    win/lose per rollout, so both rollouts of a group differ whatever the finishing order.
    Deterministic, unlike a hash of the rollout id (random ids made the top-up flaky)."""
    if int(task_id[1:]) % 2:
        return False
    with COIN_LOCK:
        COIN[task_id] += 1
        return COIN[task_id] % 2 == 0


def reward(task: dict, answer: str) -> float:
    return float(answer.strip() == str(task["answer"]))


class Stack:
    """Store + gateway (scripted engine) + a runner, in one process."""

    def __init__(self, tokenizer_dir: Path, db: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.engine = ScriptedEngine(tokenizer)
        self.store = SqliteStore(db)
        # As the real stack does: the starting weights' version comes from the store.
        self.engine.policy_version = self.store.issue_version(["policy"])
        gateway = Gateway(self.store, {"policy": ServedModel("policy", self.engine, tokenizer)})
        self.server: BackgroundServer = serve_in_thread(create_app(gateway))
        self.threads = ThreadPoolExecutor(16)

    def agents(self) -> Agents:
        cfg = RunnerConfig(concurrency=16, poll_s=0.01)
        return Agents(self.server.url, python_agent(agent, self.threads), reward, cfg)

    def runner(self) -> Runner:
        return self.agents().runner(self.store)

    def close(self) -> None:
        self.server.stop()
        self.threads.shutdown(wait=False, cancel_futures=True)
        self.store.close()


@pytest.fixture
def stack(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tiny_model_dir, tmp_path / "traces.db")
    yield s
    s.close()
    SLOW.clear()
    COIN.clear()


NONE = Curation([], group_size=2)
"""No curation: groups of two."""


def _tasks(n: int, coin: bool = False) -> list[Task]:
    return [
        Task(
            id=f"t{i}", input={"question": "What is 37+48?", "id": f"t{i}", "coin": coin}, answer=85
        )
        for i in range(n)
    ]


def _index(group_id: str) -> int:
    return int(group_id.split("/g")[1].split("-")[0])


def test_windowed_fifo_trains_around_a_long_tail(stack: Stack) -> None:
    order = TaskOrder(_tasks(8), per_step=1, seed=0)
    SLOW[order.task(0).id] = 1.5  # the first task issued is slow; the others take ms
    source = AsyncSource("run", stack.store, stack.agents(), order, NONE, lambda: 0, window=2)
    try:
        t0 = time.perf_counter()
        taken = [_index(g.id) for g in source.batch(0)]
        assert taken != [0] and time.perf_counter() - t0 < 1.5  # did not wait for it
        while 0 not in taken:  # and it is trained once done: the oldest never starves
            taken += [_index(g.id) for g in source.batch(len(taken))]
        assert len(taken) == len(set(taken))
        assert source.utilisation() > 0
    finally:
        source.close()


def test_window_bounds_how_far_training_runs_ahead(stack: Stack) -> None:
    order = TaskOrder(_tasks(8), per_step=1, seed=0)
    SLOW.update({order.task(0).id: 1.0, order.task(1).id: 1.0})  # the two oldest are slow
    source = AsyncSource("run", stack.store, stack.agents(), order, NONE, lambda: 0, window=2)
    try:
        t0 = time.perf_counter()
        batch = source.batch(0)
        # Newer groups finish first, but only the oldest `window` pending may be taken.
        assert _index(batch[0].id) in (0, 1) and time.perf_counter() - t0 >= 0.9
    finally:
        source.close()


@pytest.mark.parametrize("stale", ["drop", "requeue"])
def test_spans_beyond_max_staleness_are_never_trained(stack: Stack, stale: str) -> None:
    tasks = _tasks(4)
    order = TaskOrder(tasks, per_step=2, seed=0)
    version = [0]
    source = AsyncSource(
        "run",
        stack.store,
        stack.agents(),
        order,
        NONE,
        lambda: version[0],
        max_staleness=1,
        stale=stale,  # type: ignore[arg-type]
    )
    try:
        source.start()
        deadline = time.monotonic() + 20
        while stack.store.counts().get("succeeded", 0) < 8:  # 4 pending groups, v0
            assert time.monotonic() < deadline
            time.sleep(0.02)
        version[0] = 3  # the trainer moved on: v0 rollouts are 3 versions old (> 1)
        stack.engine.policy_version = 3
        batch = source.batch(0)
    finally:
        source.close()
    for group in batch:
        for f in group.rollouts:
            versions = {s.policy_version for s in stack.store.spans(f.id, f.rollout.attempt)}
            assert min(versions) >= version[0] - 1
            assert [s.id for s in f.spans] == [s.id for s in stack.store.spans(f.id)]
    if stale == "drop":
        assert source.stats.stale_dropped >= 4 and all(not g.rollouts for g in batch)
    else:  # the same groups, re-run by the current policy
        assert source.stats.stale_requeued >= 4
        assert all(len(g.rollouts) == 2 for g in batch)


def test_pause_stops_issuing_and_state_rebuilds_pending(stack: Stack) -> None:
    tasks = _tasks(6)
    order = TaskOrder(tasks, per_step=2, seed=0)
    source = AsyncSource(
        "run", stack.store, stack.agents(), order, NONE, lambda: 0, max_staleness=1
    )
    try:
        source.batch(0)
        source.pause(True)
        time.sleep(0.1)  # an _issue already under way finishes its top-up
        state = source.state()
        issued = source.issued
        source.batch(1)  # pending groups can still be trained while paused
        time.sleep(0.2)
        assert source.issued == issued
    finally:
        source.close()
    assert 4 <= state.issued <= 6 and state.consumed_below + len(state.consumed) == 2
    resumed = AsyncSource("run", stack.store, stack.agents(), order, NONE, lambda: 0)
    resumed.load_state(SourceState.model_validate_json(state.model_dump_json()))
    # Groups issued after the checkpoint are found in the store, in issue order.
    assert resumed.issued == issued
    consumed = set(range(state.consumed_below)) | set(state.consumed)
    assert [p.index for p in resumed.pending] == [k for k in range(issued) if k not in consumed]


def test_sync_dynamic_sampling_tops_up_groups_without_signal(stack: Stack) -> None:
    tasks = _tasks(40, coin=True)
    order = TaskOrder(tasks, per_step=4, seed=0)
    curation = Curation.build(CurationConfig(dynamic_sampling=True), 2, success_threshold=1.0)
    source = SyncSource("run", stack.store, stack.agents(), order, curation)
    batch = source.batch(0)
    assert len(batch) == 4
    for group in batch:  # every group trained on has reward variance
        assert len({f.reward for f in group.rollouts}) == 2
    dropped = curation.metrics()["curation/dropped_zero_variance"]
    issued = {r.group_id for r in stack.store.rollouts()}
    assert dropped > 0 and len(issued) == 4 + dropped  # each dropped group was replaced


def test_runner_utilisation_counts_busy_slots(stack: Stack) -> None:
    runner = stack.runner()
    stack.store.add_tasks(_tasks(4))
    stack.store.enqueue([f"t{i}" for i in range(4)])
    SLOW.update({f"t{i}": 0.2 for i in range(4)})
    asyncio.run(runner.run(until_idle=True))
    assert 4 * 0.2 <= runner.busy_s < 4 * 2.0


def test_close_cancels_in_flight_rollouts_and_writes_nothing_after(stack: Stack) -> None:
    """Regression: close() said in-flight rollouts were abandoned but waited for them (up
    to 30 s), and the run then closed the store while that thread could still write."""
    tasks = _tasks(4)
    SLOW.update({t.id: 3.0 for t in tasks})
    source = AsyncSource(
        "run", stack.store, stack.agents(), TaskOrder(tasks, 2, 0), NONE, lambda: 0
    )
    source.start()
    deadline = time.monotonic() + 20
    while stack.store.counts().get("running", 0) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    t0 = time.perf_counter()
    source.close()
    assert time.perf_counter() - t0 < 2.0  # did not wait for the 3 s agents
    before = [(r.id, r.status, r.attempt) for r in stack.store.rollouts()]
    time.sleep(3.5)  # the agents' sleeps end; their runner is gone
    assert [(r.id, r.status, r.attempt) for r in stack.store.rollouts()] == before
    assert stack.store.counts().get("succeeded", 0) == 0


def test_pause_leaves_the_queue_to_another_pool(stack: Stack) -> None:
    """Regression: while paused for an evaluation, the source's runner still claimed the
    evaluation's rollouts, so the evaluation's progress bar froze and it ran slower."""
    tasks = _tasks(4)
    source = AsyncSource(
        "run", stack.store, stack.agents(), TaskOrder(tasks, 2, 0), NONE, lambda: 0
    )
    try:
        source.batch(0)
        source.pause(True)
        time.sleep(0.3)  # rollouts already claimed finish; nothing new is claimed
        stack.store.enqueue(["t0", "t1"], group_id="eval")
        time.sleep(0.5)
        assert {r.status.value for r in stack.store.rollouts(group_id="eval")} == {"queued"}
        source.pause(False)
        deadline = time.monotonic() + 20
        while any(r.status.value == "queued" for r in stack.store.rollouts(group_id="eval")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        source.close()


def _losing_tasks(n: int) -> list[Task]:
    """Coin tasks with odd ids: every rollout loses, so no group has a reward signal."""
    return [
        Task(id=f"t{2 * i + 1}", input={"question": "What is 37+48?", "id": f"t{2 * i + 1}",
             "coin": True}, answer=85)
        for i in range(n)
    ]  # fmt: skip


def _batch_in_thread(source: AsyncSource, step: int, timeout: float) -> dict[str, object]:
    """source.batch(step) in a thread, joined for `timeout` s: {"groups"} or {"error"}; an
    empty dict when it never returned (the thread is left behind, a daemon)."""
    out: dict[str, object] = {}

    def target() -> None:
        try:
            out["groups"] = source.batch(step)
        except Exception as e:
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    return out


def test_async_dynamic_sampling_gives_up_on_a_batch_without_signal(stack: Stack) -> None:
    """Regression: with every group of equal reward, batch() never returned."""
    order = TaskOrder(_losing_tasks(8), per_step=2, seed=0)
    curation = Curation.build(CurationConfig(dynamic_sampling=True), 2, success_threshold=1.0)
    source = AsyncSource("run", stack.store, stack.agents(), order, curation, lambda: 0)
    try:
        out = _batch_in_thread(source, 0, timeout=30)
    finally:
        source.close()
    assert out, "batch() never returned"
    error = out.get("error")
    assert isinstance(error, NoBatch) and "same reward" in str(error)
    # As sync mode after its top-ups: the step's groups plus max_topups rounds' worth.
    dropped = curation.metrics()["curation/dropped_zero_variance"]
    assert dropped == source.max_topups * order.per_step


def test_a_window_of_finished_groups_drops_no_more_than_the_give_up_count(stack: Stack) -> None:
    """Regression: when several groups finished between two reads of the window (a loaded
    machine), one read dropped them all, past max_topups x per_step."""
    order = TaskOrder(_losing_tasks(8), per_step=2, seed=0)
    curation = Curation.build(CurationConfig(dynamic_sampling=True), 2, success_threshold=1.0)
    source = AsyncSource("run", stack.store, stack.agents(), order, curation, lambda: 0,
                         max_topups=1)  # fmt: skip
    try:
        source.start()
        deadline = time.monotonic() + 30
        while stack.store.counts().get("succeeded", 0) < 2 * source.window:
            assert time.monotonic() < deadline, stack.store.counts()
            time.sleep(0.05)
        with pytest.raises(NoBatch, match="same reward"):
            source.batch(0)  # the whole window is complete at its first read
    finally:
        source.close()
    assert curation.metrics()["curation/dropped_zero_variance"] == order.per_step
    assert len(source.pending) >= source.window - order.per_step  # the rest wait, unread


def test_a_stop_is_obeyed_while_a_batch_waits_and_loses_no_group(stack: Stack) -> None:
    order = TaskOrder(_tasks(8), per_step=2, seed=0)
    SLOW.update({t.id: 10.0 for t in _tasks(8) if t.id != order.task(0).id})
    asked = threading.Event()
    source = AsyncSource("run", stack.store, stack.agents(), order, NONE, lambda: 0)
    source.interrupt = asked.is_set
    try:
        source.start()
        deadline = time.monotonic() + 20
        while not any(r.status.value == "succeeded" for r in stack.store.rollouts()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        threading.Timer(1.0, asked.set).start()  # `tracerl ctl stop`, while it waits
        t0 = time.perf_counter()
        out = _batch_in_thread(source, 0, timeout=5)
        assert out, "batch() did not obey the stop"
        assert time.perf_counter() - t0 < 5
        assert isinstance(out.get("error"), NoBatch) and "stop" in str(out["error"])
        # The group it had taken is pending again: a resumed run trains it.
        state = source.state()
        assert state.consumed_below == 0 and state.consumed == []
        assert [p.index for p in source.pending][:1] == [0]
    finally:
        source.close()


def test_a_resumed_source_keeps_every_replaced_stale_rollout_out(
    stack: Stack, tmp_path: Path
) -> None:
    """Regression: only groups pending at the checkpoint kept their replaced (stale)
    rollouts; a group issued after it counted the stale rollout and its replacement."""
    order = TaskOrder(_tasks(4), per_step=1, seed=0)
    version = [0]
    journal = tmp_path / "replaced.jsonl"

    def source() -> AsyncSource:
        return AsyncSource(
            "run", stack.store, stack.agents(), order, NONE, lambda: version[0],
            max_staleness=1, journal=journal,
        )  # fmt: skip

    first = source()
    checkpoint = first.state()  # before any group was issued
    try:
        first.start()
        deadline = time.monotonic() + 20
        while stack.store.counts().get("succeeded", 0) < 4:  # 2 pending groups at v0
            assert time.monotonic() < deadline
            time.sleep(0.02)
        version[0] = stack.engine.policy_version = 3  # the trainer moved on: all stale
        first.batch(0)
        assert first.stats.stale_requeued == 4
    finally:
        first.close()  # the run dies here; it resumes from the checkpoint
    resumed = source()
    resumed.load_state(SourceState.model_validate_json(checkpoint.model_dump_json()))
    try:
        batch = resumed.batch(0)
    finally:
        resumed.close()
    assert resumed.stats.stale_requeued == 0  # the replacements were found, not made again
    for group in batch:
        assert len(group.rollouts) == 2  # its size: the stale rollouts stay out
        assert all(s.policy_version == 3 for f in group.rollouts for s in f.spans)
