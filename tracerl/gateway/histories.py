"""Token histories of the rollout attempts in flight: each thread's last request and what
was sampled for it, so the thread's next call reuses those exact ids (tito.py), and which
thread each recorded span belongs to (a call naming its parent span is linked to it).

Kept per attempt, dropped when the attempt finishes here and bounded for those finished
elsewhere (another gateway's store API, an expired lease): the least recently used attempts
go first, and within an attempt its least recently used threads beyond `threads`. A
forgotten thread only costs a new thread where the old one would have gone on.
record.py keeps the same attempts' call memory beside it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tracerl.gateway.chat import Message, canonical_reply, normalize_message
from tracerl.gateway.served import Choice
from tracerl.gateway.threads import HistoryKey, Placement, Thread
from tracerl.gateway.tito import History, Prompt, Turn
from tracerl.types import Generation

__all__ = ["Histories", "text_turns"]

THREADS = 512
"""Threads kept per attempt (a long CLI session opens one per sub-agent and side call)."""
SPANS = 8 * THREADS
"""Span -> thread entries kept per attempt, for calls that name their parent span."""


@dataclass
class _Attempt:
    """One attempt's threads (least recently used first) and its spans' threads."""

    threads: OrderedDict[str, Thread] = field(default_factory=OrderedDict)
    spans: OrderedDict[str, str] = field(default_factory=OrderedDict)


class Histories:
    """Each attempt's threads, for at most `memory` attempts."""

    def __init__(self, memory: int, threads: int = THREADS) -> None:
        self.memory = memory
        """Rollout attempts whose threads are kept."""
        self.max_threads = threads
        """Threads kept per attempt."""
        self._attempts: OrderedDict[tuple[str, int], _Attempt] = OrderedDict()

    def __len__(self) -> int:
        """Attempts remembered."""
        return len(self._attempts)

    def threads(self, rollout_id: str, attempt: int) -> list[Thread]:
        """The attempt's threads, most recently used first (a snapshot)."""
        held = self._attempts.get((rollout_id, attempt))
        return list(reversed(held.threads.values())) if held else []

    def thread_of(self, rollout_id: str, attempt: int, span_id: str | None) -> str | None:
        """The thread of a span of the attempt; None when unknown (or not given)."""
        held = self._attempts.get((rollout_id, attempt))
        return held.spans.get(span_id) if held and span_id else None

    def remember(
        self,
        key: HistoryKey,
        placement: Placement,
        messages: list[Message],
        tools: list[dict] | None,
        prompt: Prompt,
        choices: list[Choice],
        span_ids: list[str],
    ) -> None:
        """Keep a call as its thread's last request, with each choice's reply; the least
        recently used attempt goes once more than `memory` are kept."""
        turns = [
            Turn(
                ids=prompt.ids + c.gen.completion_ids,
                reply=canonical_reply(c.reply, c.call_ids),
                end=_end(c.gen),
            )
            for c in choices
        ]
        pending = any(c.reply.tool_calls for c in choices)
        self.remember_turns(key, placement, messages, tools, turns, pending, span_ids)

    def remember_turns(
        self,
        key: HistoryKey,
        placement: Placement,
        messages: list[Message],
        tools: list[dict] | None,
        turns: list[Turn],
        pending: bool,
        span_ids: list[str],
    ) -> None:
        """`remember` for turns already built (a remote role's text replies have no ids)."""
        history = History(messages=messages, tools=tools, turns=turns)
        thread = Thread(placement.thread_id, placement.parent_thread_id, key, history, pending)
        held = self._attempts.setdefault(key[:2], _Attempt())
        held.threads[thread.id] = thread
        held.threads.move_to_end(thread.id)
        while len(held.threads) > self.max_threads:
            held.threads.popitem(last=False)
        for span_id in span_ids:
            held.spans[span_id] = thread.id
        while len(held.spans) > SPANS:
            held.spans.popitem(last=False)
        self._attempts.move_to_end(key[:2])
        while len(self._attempts) > self.memory:
            self._attempts.popitem(last=False)

    def forget(self, rollout_id: str, attempt: int) -> None:
        """Drop a finished attempt's threads: no call of it follows."""
        self._attempts.pop((rollout_id, attempt), None)


def text_turns(body: dict[str, Any]) -> tuple[list[Turn], bool]:
    """A remote role's reply as turns without ids (its next call can only join the thread,
    never reuse ids), and whether it called tools."""
    turns = []
    for choice in body.get("choices", []):
        try:
            reply = normalize_message(choice["message"])
        except (KeyError, TypeError, ValueError):  # a reply its server spelled oddly
            continue
        turns.append(Turn(ids=[], reply=reply, end="eos"))
    return turns, any(t.reply.get("tool_calls") for t in turns)


def _end(gen: Generation) -> str:
    """How a sampled turn ended, as tito.Turn records it."""
    if gen.stop_string:
        return "stop_string"
    return "eos" if gen.finish_reason == "stop" else "length"
