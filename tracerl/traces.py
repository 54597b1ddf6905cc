"""Reading traces: one rollout with each model call, as a person wants to see it.

Calls of a sub-agent sit under the call that spawned it (the span's parent), so a planner
that runs executors — or itself, recursively — reads as a tree. Each call shows only the
messages its conversation had not shown yet. A status reads as what it means
("answered", not "succeeded": see RolloutStatus.shown). Each run remembers its store in
runs/.latest_store, so `tracerl traces` reads the last run's without being told where.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from tracerl.store import NotFound, Store
from tracerl.store.open import is_postgres_url
from tracerl.store.open import open_store as open_any_store
from tracerl.store.sqlite import SqliteStore
from tracerl.types import STATUS_SHOWN, Rollout, Span

LATEST = Path("runs") / ".latest_store"
"""Where the last run (demo, train, eval) noted its store file, relative to the cwd."""


def remember_store(path: str | Path) -> None:
    """Note `path` (a file, or a store URL) as the last run's store."""
    LATEST.parent.mkdir(parents=True, exist_ok=True)
    url = isinstance(path, str) and "://" in path
    LATEST.write_text(str(path) if url else str(Path(path).resolve()))


def open_store(path: str | None) -> Store:
    """The store at a file path or URL, or the last run's (SystemExit saying what is
    missing: a CLI reads stores a person names)."""
    if path is None:
        if not LATEST.exists():
            raise SystemExit("no store given and no previous run found; pass --store PATH")
        path = LATEST.read_text().strip()
    if is_postgres_url(path):
        return open_any_store(path)
    if path.startswith("http"):
        from tracerl.store.http import StoreClient  # fastapi and httpx load only for a URL

        return StoreClient(path)
    if not Path(path).exists():
        raise SystemExit(f"no store at {path}")
    return SqliteStore(path)


def _message_line(msg: dict) -> str:
    role = msg.get("role", "?")
    text = str(msg.get("content") or "")
    calls = msg.get("tool_calls") or []
    for call in calls:
        fn = call.get("function", {})
        args = fn.get("arguments")
        args = args if isinstance(args, str) else json.dumps(args)
        text += f" -> {fn.get('name')}({args})"
    return f"[bold]{role}[/bold]: {text}"


def _span_node(span: Span, seen: int) -> Tree:
    reuse = (
        f"reused {span.prefix_reused}"
        if span.prefix_break is None
        else f"[red]prefix break: {span.prefix_break}[/red]"
    )
    tokens = (
        f"policy v{span.policy_version} · {len(span.prompt_ids)} prompt tok ({reuse}) · "
        f"{len(span.completion_ids)} completion tok"
        if span.completion_ids
        else "remote, text only"  # a frozen role served by a URL elsewhere
    )
    head = (
        f"call {span.seq} · role {span.role} · {tokens}"
        f" · {span.latency_s * 1000:.1f} ms · {span.finish_reason}{_thread(span)}"
    )
    node = Tree(head)
    for msg in span.messages[seen:]:
        node.add(_message_line(msg))
    message = span.response.get("message")
    if isinstance(message, dict):
        node.add("[green]" + _message_line(message) + "[/green]")
    return node


def _thread(span: Span) -> str:
    """Which conversation of the rollout the call belongs to (and which it branched from)."""
    if span.thread_id is None:
        return ""
    branched = f" from {span.parent_thread_id[:8]}" if span.parent_thread_id else ""
    return f" · thread {span.thread_id[:8]}{branched}"


def _shown(span: Span, earlier: list[Span]) -> int:
    """How many of the span's messages an earlier call of its conversation already showed.

    The conversation is the latest earlier call of the same role whose messages are a
    prefix of this call's (the reply it got is the next message); 0 when none is.
    """
    for prev in reversed(earlier):
        n = len(prev.messages)
        if (
            prev.role == span.role
            and 0 < n < len(span.messages)
            and span.messages[:n] == prev.messages
        ):
            return n + 1
    return 0


def resolve_rollout_id(store: Store, text: str) -> str:
    """The rollout `text` names: its whole id, or any prefix only one rollout's id starts
    with (what `traces list` prints). NotFound says why when none or several match."""
    try:
        return store.get_rollout(text).id
    except NotFound:
        pass
    matches = [r.id for r in store.rollouts() if r.id.startswith(text)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise NotFound(f"no rollout '{text}'")
    shown = ", ".join(matches[:5]) + (", ..." if len(matches) > 5 else "")
    raise NotFound(f"'{text}' starts {len(matches)} rollout ids ({shown}): give more of it")


def show_rollout(store: Store, rollout_id: str, console: Console | None = None) -> None:
    """Print a rollout: its state, then each call (children under their parent span). The
    id may be any unique prefix."""
    console = console or Console()
    rollout_id = resolve_rollout_id(store, rollout_id)
    rollout = store.get_rollout(rollout_id)
    spans = store.spans(rollout_id)
    rewards = store.rewards(rollout_id)
    console.print(_header(rollout))
    root = Tree(f"rollout {rollout.id} · task {rollout.task_id}")
    nodes: dict[str, Tree] = {}
    for i, span in enumerate(spans):
        parent = nodes.get(span.parent_span_id or "", root)
        node = _span_node(span, _shown(span, spans[:i]))
        parent.add(node)
        nodes[span.id] = node
    console.print(root)
    for r in rewards:
        where = "final" if r.span_seq is None else f"call {r.span_seq}"
        where = f"role {r.role}" if r.role is not None else where
        console.print(f"reward {r.name} ({where}): {r.value:g}")


def _header(rollout: Rollout) -> Table:
    table = Table(show_header=False, box=None)
    for key in ("id", "task_id", "status", "attempt", "reward", "answer", "error"):
        value = getattr(rollout, key)
        if value is not None:
            table.add_row(key, STATUS_SHOWN[value] if key == "status" else str(value))
    if rollout.started_at and rollout.finished_at:
        table.add_row("wall", f"{rollout.finished_at - rollout.started_at:.2f} s")
    return table


ID_SHOWN = 12
"""Characters of a rollout id `traces list` prints: unique in practice, and `traces show`
takes any unique prefix."""


def list_rollouts(store: Store, limit: int = 20, console: Console | None = None) -> None:
    """Print the most recent rollouts, one line each, laid out for 80 columns: an id prefix
    long enough to tell them apart (`traces show` takes it), task, status, attempt and reward
    at fixed widths, and the answer in what the terminal's width leaves."""
    console = console or Console()
    rows = store.rollouts()[-limit:]
    width = _id_width([r.id for r in rows])
    task_width = min(18, max((len(r.task_id) for r in rows), default=4))
    # The answer gets what the fixed columns leave, cut here: rich would rather drop columns.
    room = max(10, console.width - (width + task_width + 9 + 3 + 6 + 5))
    table = Table(box=None, pad_edge=False, padding=(0, 1))
    table.add_column("rollout", no_wrap=True, min_width=width, max_width=width)
    table.add_column("task", no_wrap=True, overflow="ellipsis", min_width=task_width, max_width=18)
    table.add_column("status", no_wrap=True, min_width=9)
    table.add_column("try", no_wrap=True, justify="right", min_width=3)
    table.add_column("reward", no_wrap=True, justify="right", min_width=6)
    table.add_column("answer", no_wrap=True, overflow="ellipsis", max_width=room)
    for r in rows:
        answer = (r.answer or "").replace("\n", " ")
        answer = answer if len(answer) <= room else answer[: room - 1] + "…"
        reward = "–" if r.reward is None else f"{r.reward:g}"
        table.add_row(
            r.id[:width], r.task_id, STATUS_SHOWN[r.status], str(r.attempt), reward, answer
        )
    console.print(table)


def _id_width(ids: list[str]) -> int:
    """The shortest prefix length, at least ID_SHOWN, that tells the listed ids apart."""
    width = ID_SHOWN
    while width < max((len(i) for i in ids), default=0) and len({i[:width] for i in ids}) < len(
        ids
    ):
        width += 2
    return width
