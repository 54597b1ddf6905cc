"""Conversations inside one rollout: each is a thread. A call that extends an earlier call's
conversation joins its thread (and reuses its ids); a new conversation starts a thread of
its own, linked to the thread it branched from (a sub-agent started from a pending tool
call, a compaction that keeps the opening, a call naming its parent). Interleaved
conversations of one session break no prefix; each thread becomes its own training rows;
the thread columns are stored (and added to older SQLite files and Postgres databases)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psycopg
import pytest
from transformers import AutoTokenizer

from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.examples import example_module
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store.sqlite import SqliteStore
from tracerl.types import Span

from .pg import pg_server, pg_url  # noqa: F401
from .scripted import ScriptedEngine, running_rollout

TOOLS = example_module("calculator", "agent").TOOLS


def _ask(sys: str, user: str) -> list[dict]:  # type: ignore[type-arg]
    return [{"role": "system", "content": sys}, {"role": "user", "content": user}]


@pytest.fixture
def served(tiny_model_dir: Path) -> Iterator[tuple[BackgroundServer, SqliteStore]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = SqliteStore(":memory:")
    gateway = Gateway(
        store, {"policy": ServedModel("policy", ScriptedEngine(tokenizer), tokenizer)}
    )
    server = serve_in_thread(create_app(gateway))
    yield server, store
    server.stop()
    store.close()


def _client(url: str, headers: dict[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, default_headers=headers)


def _call(client: openai.OpenAI, messages: list[dict]) -> dict:  # type: ignore[type-arg]
    """One call; the history extended by its reply (and a tool result when it calls)."""
    reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    msg = reply.choices[0].message
    history = [*messages, msg.model_dump(exclude_none=True)]
    if msg.tool_calls:
        history.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "85"})
    return {"id": reply.id, "history": history}


def _session_spans(store: SqliteStore) -> list[Span]:
    [rollout] = store.rollouts()
    return store.spans(rollout.id)


def test_interleaved_conversations_of_a_session_are_threads_without_prefix_breaks(
    served,  # type: ignore[no-untyped-def]
) -> None:
    server, store = served
    client = _client(server.url, {"X-Session-Id": "s"})
    a1 = _call(client, _ask("Use the calculator.", "What is 37+48?"))
    b1 = _call(client, _ask("Use the calculator.", "What is 40+45?"))
    _call(client, a1["history"])
    _call(client, b1["history"])
    sa1, sb1, sa2, sb2 = _session_spans(store)
    assert [s.prefix_break for s in (sa1, sb1, sa2, sb2)] == [None] * 4
    for first, second in ((sa1, sa2), (sb1, sb2)):
        head = first.prompt_ids + first.completion_ids
        assert second.prefix_reused == len(head) and second.prompt_ids[: len(head)] == head
        assert first.thread_id == second.thread_id == first.id
    assert sa1.thread_id != sb1.thread_id
    # Each thread is its own training row, holding both of its calls.
    rows = spans_to_transitions([sa1, sb1, sa2, sb2], 1.0, group_id="g", task_id="t")
    assert [r.span_ids for r in rows] == [[sa1.id, sa2.id], [sb1.id, sb2.id]]


def test_new_threads_are_linked_to_the_thread_they_branch_from(served) -> None:  # type: ignore[no-untyped-def]
    server, store = served
    client = _client(server.url, {"X-Session-Id": "s"})
    a1 = _call(client, _ask("Use the calculator.", "What is 37+48?"))  # a tool call: pending
    _call(client, _ask("You are a sub-agent.", "Compute 37+48."))  # started inside that call
    _call(client, a1["history"])  # the main thread answers: nothing pending
    x1 = _call(client, _ask("You translate.", "Say hi in French."))  # unrelated
    _call(client, x1["history"])
    y1 = _call(client, _ask("Use the calculator.", "What is 2+2?"))  # the agent run again
    _call(client, y1["history"])
    # A compaction: the opening kept, the rest of the conversation replaced by a summary.
    summary = {"role": "user", "content": "Summary so far: 37+48 is 85. Go on."}
    _call(client, [*a1["history"][:2], summary])
    main, sub, main2, other, other2, again, again2, compacted = _session_spans(store)
    spans = (main, sub, main2, other, other2, again, again2, compacted)
    assert [s.prefix_break for s in spans] == [None] * 8
    assert main2.thread_id == main.thread_id and other2.thread_id == other.thread_id
    assert len({main.thread_id, sub.thread_id, other.thread_id, compacted.thread_id}) == 4
    assert sub.parent_thread_id == main.thread_id
    assert other.parent_thread_id is None
    assert again.parent_thread_id is None  # the same system prompt, another task
    assert compacted.parent_thread_id == main.thread_id
    assert main.parent_thread_id is None and main2.parent_thread_id is None


def test_a_named_parent_links_the_threads(served) -> None:  # type: ignore[no-untyped-def]
    server, store = served
    rid = running_rollout(store)
    planner = _client(server.url, {"X-Tracerl-Rollout": rid})
    plan = _call(planner, _ask("Plan.", "What is 37+48?"))
    _call(planner, _ask("Plan something else.", "And 1+1?"))  # the most recent thread now
    executor = _client(server.url, {"X-Tracerl-Rollout": rid, "X-Tracerl-Parent": plan["id"]})
    _call(executor, _ask("Execute.", "37+48"))
    first, _, sub = store.spans(rid)
    assert sub.parent_span_id == first.id and sub.parent_thread_id == first.thread_id


def test_spans_of_two_threads_never_share_a_row() -> None:
    def span(seq: int, thread: str | None, prompt: list[int], completion: list[int]) -> Span:
        return Span(
            id=f"s{seq}", rollout_id="r", attempt=1, seq=seq, role="policy", policy_version=0,
            prompt_ids=prompt, completion_ids=completion, logprobs=[0.0] * len(completion),
            thread_id=thread,
        )  # fmt: skip

    # The second thread's prompt happens to extend the first's sequence: still its own row.
    threads = [span(0, "s0", [1, 2], [3]), span(1, "s1", [1, 2, 3, 4], [5])]
    rows = spans_to_transitions(threads, 1.0, group_id="g", task_id="t")
    assert [r.span_ids for r in rows] == [["s0"], ["s1"]]
    # Spans recorded before threads existed merge by their prefixes, as they always did.
    legacy = [span(0, None, [1, 2], [3]), span(1, None, [1, 2, 3, 4], [5])]
    rows = spans_to_transitions(legacy, 1.0, group_id="g", task_id="t")
    assert [r.span_ids for r in rows] == [["s0", "s1"]]


def _threaded(rollout_id: str, seq: int) -> Span:
    return Span(
        id=f"{rollout_id}-{seq}", rollout_id=rollout_id, attempt=1, seq=seq, role="policy",
        policy_version=0, prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.5],
        thread_id=f"{rollout_id}-0", parent_thread_id="elsewhere" if seq else None, created_at=1.0,
    )  # fmt: skip


def test_sqlite_keeps_the_threads_and_older_files_get_the_columns(tmp_path: Path) -> None:
    path = tmp_path / "traces.db"
    store = SqliteStore(path)
    rid = running_rollout(store)
    store.add_spans([_threaded(rid, 0)])
    store.close()
    # A file written before threads existed: no thread columns, a span without them.
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE spans DROP COLUMN thread_id")
        db.execute("ALTER TABLE spans DROP COLUMN parent_thread_id")
    store = SqliteStore(path)
    (old,) = store.spans(rid)
    assert old.thread_id is None and old.parent_thread_id is None
    store.add_spans([_threaded(rid, 1)])
    assert store.spans(rid)[1] == _threaded(rid, 1)
    store.close()


def test_postgres_keeps_the_threads_and_older_databases_are_migrated(pg_url: str) -> None:  # noqa: F811
    from tracerl.store.postgres import PostgresStore
    from tracerl.store.postgres_schema import MIGRATIONS, migrate

    with psycopg.connect(pg_url, autocommit=True) as conn:
        migrate(conn, MIGRATIONS[:1])  # a database made before threads existed
    store = PostgresStore(pg_url)
    rid = running_rollout(store)
    store.add_spans([_threaded(rid, 0), _threaded(rid, 1)])
    assert store.spans(rid) == [_threaded(rid, 0), _threaded(rid, 1)]
    store.close()


def test_the_store_api_carries_the_threads(served) -> None:  # type: ignore[no-untyped-def]
    server, store = served
    rid = running_rollout(store)
    store.add_spans([_threaded(rid, 0)])
    (span,) = httpx.get(f"{server.url}/store/rollouts/{rid}/spans").json()
    assert span["thread_id"] == f"{rid}-0"
