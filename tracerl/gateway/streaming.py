"""Token-by-token streaming: a call's text sent as its tokens are sampled, in every wire
format (chat and completions here; Responses and Messages build on `stream_call`).

The engine hands out ids per decode step (tracerl.engines.base.stream). `TextDeltas` turns
them into pieces of the text the finished reply will hold, and never sends a piece the
finished reply would not start with:

- bytes of a character split across tokens wait for the token that completes it;
- text that could be the start of a stop string waits until it cannot (a stop string
  and what follows it never reach the agent);
- special tokens the agent never sees (the end token) are dropped;
- with tools, text stops where the model's format opens a call (`<tool_call>`,
  `[TOOL_CALLS]`, ...): calls are parsed once the completion ends;
- a model's reasoning (`<think>...</think>`) is no content: it waits until it closes and is
  then handed out whole, as a `Thought`, before any content;
- a reply's leading and trailing whitespace waits (the finished reply is stripped).

When the completion ends, `finish` gives whatever of the reply was not sent yet. The span
recorded is still the whole sampled completion (Gateway.run records it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from tracerl.gateway.chat import wire_message
from tracerl.gateway.core import Gateway
from tracerl.gateway.served import Choice, Pending, Served, ServedModel, decode
from tracerl.gateway.toolcalls.reasoning import split_reasoning

__all__ = [
    "TextDeltas",
    "Thought",
    "chat_events",
    "completion_events",
    "sse",
    "stream_call",
    "usage_of",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Thought:
    """A streamed reply's reasoning, whole, once it has closed (before any content)."""

    text: str
    """The reasoning, stripped (what the reply's `reasoning` holds)."""


_RUNNING: set[asyncio.Task[Served]] = set()
"""Streamed calls in flight, held until done (a cancelled one until its cancellation lands)."""


class TextDeltas:
    """Pieces of one choice's visible text, from its token ids as they arrive."""

    def __init__(self, served: ServedModel, stops: list[str], tools: bool, strip: bool) -> None:
        self.served = served
        self.stops = [s for s in stops if s]
        self.tools = tools
        self.strip = strip
        """A chat reply (stripped, tool calls cut out) rather than a raw completion's text."""
        self.ids: list[int] = []
        self.raw = ""
        """Decoded text of the ids so far, special tokens included."""
        self.sent = ""
        """What has been handed out."""
        self.thought: str | None = None
        """The reasoning, once it has closed; None before (or when there is none)."""
        self.thought_sent = False
        """Whether `take_thought` has handed it out."""
        self._prefix = 0  # ids[_prefix:_read] decode to raw's last piece: the decoding context
        self._read = 0

    def push(self, ids: list[int]) -> str:
        """The new piece of text these ids complete ('' while it must wait)."""
        self.ids.extend(ids)
        window = decode(self.served.tokenizer, self.ids[self._prefix :], skip_special=False)
        if window.endswith("\ufffd"):
            return ""  # a character split across tokens: its last bytes are still to come
        seen = decode(self.served.tokenizer, self.ids[self._prefix : self._read], False)
        self.raw += window[len(seen) :]
        self._prefix, self._read = self._read, len(self.ids)
        return self._advance(self._safe())

    def take_thought(self) -> str | None:
        """The reasoning, the first time it is asked for once it has closed."""
        if self.thought is None or self.thought_sent:
            return None
        self.thought_sent = True
        return self.thought

    def finish(self, final: str) -> str:
        """What of the finished text `final` was not sent yet."""
        if final.startswith(self.sent):
            return final[len(self.sent) :]
        # Never expected (every piece sent is a prefix of the reply by construction); the
        # agent then holds text it should not, so say so.
        log.warning("streamed text %r is not a prefix of the reply %r", self.sent, final)
        return ""

    def _safe(self) -> str:
        """The visible text that no later token can change."""
        raw, cut = self.raw, len(self.raw)
        hits = [at for at in (raw.find(s) for s in self.stops) if at >= 0]
        if hits:
            cut = min(hits)
        else:
            cut -= _partial(raw, self.stops)
        text = self.served.hide(raw[:cut])
        if not self.strip:
            return text
        text = self._past_reasoning(text)
        if self.tools:
            opens = list(self.served.tool_format.opens)
            hits = [at for at in (text.find(o) for o in opens) if at >= 0]
            text = text[: min(hits)] if hits else text[: len(text) - _partial(text, opens)]
        return text.strip()

    def _past_reasoning(self, text: str) -> str:
        """The text after the reasoning; '' while the reasoning may still be open."""
        markers = self.served.reasoning
        if markers is None:
            return text
        head = text.lstrip()
        if not head or markers.start.startswith(head) and head != markers.start:
            return ""  # it may yet open a reasoning
        if not head.startswith(markers.start) and not markers.open_in_prompt:
            return text
        thought, rest = split_reasoning(text, markers)
        if markers.end not in text:
            return ""
        if self.thought is None:
            self.thought = thought
        return rest

    def _advance(self, safe: str) -> str:
        if not safe.startswith(self.sent) or len(safe) == len(self.sent):
            return ""
        piece, self.sent = safe[len(self.sent) :], safe
        return piece


def _partial(text: str, marks: list[str]) -> int:
    """Length of the longest end of `text` that begins one of `marks` (and may complete it)."""
    longest = 0
    for mark in marks:
        for k in range(min(len(mark) - 1, len(text)), longest, -1):
            if text.endswith(mark[:k]):
                longest = k
                break
    return longest


async def stream_call(
    gateway: Gateway, p: Pending, strip: bool = True
) -> AsyncIterator[str | Thought | Served]:
    """Run a checked one-choice call: pieces of its text as they are sampled (its Thought
    first, if it reasons), then the Served (whose first choice's content the pieces add up
    to). If the consumer stops early (the client went away), sampling is cancelled and
    nothing is recorded, as for a plain call whose client disconnects."""
    text = TextDeltas(p.served, p.params.stop, p.tools is not None, strip)
    pieces: asyncio.Queue[str | Thought | asyncio.Task[Served]] = asyncio.Queue()

    def on_tokens(ids: list[int]) -> None:
        piece = text.push(ids)
        thought = text.take_thought()
        if thought is not None:
            pieces.put_nowait(Thought(thought))
        if piece:
            pieces.put_nowait(piece)

    task = asyncio.ensure_future(gateway.run(p, on_tokens))
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    task.add_done_callback(pieces.put_nowait)
    try:
        while True:
            item = await pieces.get()
            if not isinstance(item, asyncio.Task):
                yield item
                continue
            served = item.result()
            c = served.choices[0]
            if strip and c.reply.reasoning and not text.thought_sent:
                yield Thought(c.reply.reasoning)  # it never closed, or it closed at the end
            rest = text.finish(c.reply.content if strip else c.text)
            if rest:
                yield rest
            yield served
            return
    finally:
        if not task.done():
            task.cancel()  # the consumer left before the call ended: stop sampling


def sse(body: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event (with an `event:` line when the format names its events)."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(body) + b"\n\n"


def usage_of(served: Served) -> dict[str, int]:
    """OpenAI chat/completions usage."""
    return {
        "prompt_tokens": served.prompt_tokens,
        "completion_tokens": served.completion_tokens,
        "total_tokens": served.prompt_tokens + served.completion_tokens,
    }


async def chat_events(gateway: Gateway, p: Pending, usage: bool) -> AsyncIterator[bytes]:
    """A chat completion as chunks: content deltas as tokens arrive, tool calls once parsed,
    the finish reason, the usage when asked (every chunk before it then says "usage": null,
    as OpenAI's do), [DONE]."""
    head = _head(p, "chat.completion.chunk", usage)

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return sse({**head, "choices": [choice]})

    served: Served | None = None
    if p.n == 1:
        yield chunk(0, {"role": "assistant", "content": ""})
        async for item in stream_call(gateway, p):
            if isinstance(item, Thought):
                yield chunk(0, {"reasoning_content": item.text})
            elif isinstance(item, str):
                yield chunk(0, {"content": item})
            else:
                served = item
    else:  # several choices: each sent whole once all are sampled
        served = await gateway.run(p)
        for c in served.choices:
            delta = {"role": "assistant", "content": c.reply.content}
            if c.reply.reasoning:
                delta["reasoning_content"] = c.reply.reasoning
            yield chunk(c.index, delta)
    assert served is not None, "stream_call ends with the Served"
    for c in served.choices:
        if c.reply.tool_calls:
            yield chunk(c.index, {"tool_calls": _call_deltas(c)})
        yield chunk(c.index, {}, c.finish_reason)
    if usage:
        yield sse({**head, "choices": [], "usage": usage_of(served)})
    yield b"data: [DONE]\n\n"


def _call_deltas(c: Choice) -> list[dict[str, Any]]:
    calls = wire_message(c.reply, c.call_ids)["tool_calls"]
    return [{"index": i, **call} for i, call in enumerate(calls)]


async def completion_events(gateway: Gateway, p: Pending, usage: bool) -> AsyncIterator[bytes]:
    """A text completion as chunks: text as tokens arrive, then the finish reason, the usage
    when asked (with "usage": null on every chunk before it), [DONE]."""
    head = _head(p, "text_completion", usage)

    def chunk(index: int, text: str, finish: str | None = None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        return sse({**head, "choices": [choice]})

    served: Served | None = None
    if p.n == 1:
        async for item in stream_call(gateway, p, strip=False):
            if isinstance(item, Served):
                served = item
            elif isinstance(item, str):
                yield chunk(0, item)
    else:
        served = await gateway.run(p)
        for c in served.choices:
            yield chunk(c.index, c.text)
    assert served is not None, "stream_call ends with the Served"
    for c in served.choices:
        yield chunk(c.index, "", c.finish_reason)
    if usage:
        yield sse({**head, "choices": [], "usage": usage_of(served)})
    yield b"data: [DONE]\n\n"


def _head(p: Pending, kind: str, usage: bool) -> dict[str, Any]:
    """The fields every chunk of a call repeats; with usage asked for, "usage": null until
    the last chunk carries it."""
    head: dict[str, Any] = {
        "id": f"{p.kind}-{p.span_id}",
        "object": kind,
        "created": int(time.time()),
        "model": p.model,
    }
    return head | {"usage": None} if usage else head
