"""Threads: the conversations inside one rollout attempt, and which one a call belongs to.

One attempt may hold many conversations: a coding CLI's session runs a main conversation,
sub-agents, compactions and side calls; framework agents run one after another under one
API key share a session. Each is a thread, and each thread is its own trajectory: its calls
reuse each other's token ids, its prefix breaks are its own, its spans become its own
training rows. A thread's id is the id of its first span.

A call of an agent (rollout, attempt, role, parent span: `HistoryKey`) joins a thread of
that agent when it extends the thread's last request: first a thread whose returned
assistant message it carries unchanged (token-in/token-out reuses the ids), then one whose
messages it extends all the same (a prefix break within the thread: tools changed, the
assistant message re-serialised, ...). Otherwise it starts a thread, linked to the thread
it branched from:

1. the thread of the span the call names as its parent (X-Tracerl-Parent);
2. else the attempt's most recently used thread, when its last reply called tools: the
   new conversation started inside that tool call (a sub-agent);
3. else the thread sharing the longest opening with it, one that goes past the system
   messages (a compaction keeps the task, a fork its first turns; two runs of one agent
   share only the system prompt, and are not linked);
4. else none: a conversation of its own.

Rules 2 and 3 are guesses from what a client sends; a client that knows its agents' tree
names it with X-Tracerl-Parent.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracerl.gateway.chat import Message
from tracerl.gateway.tito import History, match_turn

__all__ = ["HistoryKey", "Placement", "Thread", "place"]

HistoryKey = tuple[str, int, str, str | None]
"""(rollout id, attempt, role, parent span id): one agent's conversations with one model."""


@dataclass(frozen=True)
class Thread:
    """One conversation of an attempt, as its last call left it (replaced, never mutated,
    so a snapshot may be read on the tokenizer thread)."""

    id: str
    """The id of its first span."""
    parent_id: str | None
    """The thread it branched from, if any."""
    key: HistoryKey
    """The agent whose conversation it is."""
    history: History
    """Its last request and the choices returned for it."""
    pending: bool
    """Whether its last reply called tools (the agent is running them now)."""


@dataclass(frozen=True)
class Placement:
    """Where a call goes: its thread, and the history its prompt extends."""

    thread_id: str
    """The thread's id (the call's own span id when it starts one)."""
    parent_thread_id: str | None
    """The thread it branched from."""
    prev: History | None
    """The thread's last request, to extend; None for a new thread."""


def place(
    messages: list[Message],
    tools: list[dict] | None,
    key: HistoryKey,
    threads: list[Thread],
    new_id: str,
    named_parent: str | None,
) -> Placement:
    """The thread of a call (the module doc gives the rules). `threads` are the attempt's,
    most recently used first; `named_parent` is the thread of the span the call names."""
    mine = [t for t in threads if t.key == key]
    for t in mine:
        if match_turn(messages, tools, t.history)[0] is not None:
            return Placement(t.id, t.parent_id, t.history)
    for t in mine:
        k = len(t.history.messages)
        if len(messages) > k and messages[:k] == t.history.messages:
            return Placement(t.id, t.parent_id, t.history)
    return Placement(new_id, named_parent or _branched_from(messages, threads), None)


def _branched_from(messages: list[Message], threads: list[Thread]) -> str | None:
    """Rules 2 to 4: the thread awaiting a tool result, else the longest shared opening."""
    if threads and threads[0].pending:
        return threads[0].id
    best, shared = None, 0
    for t in threads:  # most recent first: ties go to the most recent
        n = _common(messages, t.history.messages)
        if n > shared:
            best, shared = t.id, n
    return best


def _common(a: list[Message], b: list[Message]) -> int:
    """How many leading messages two conversations share; 0 when those are all system
    messages (the prompt of an agent, not a conversation)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n if any(m.get("role") != "system" for m in a[:n]) else 0
