"""Attribution and span recording: which rollout attempt a call belongs to, and its spans.

The gateway's event loop never waits on the store: every store call (rollout lookup,
parent check, span and reward writes) runs on the gateway's store executor, so a slow
write (a 10 MB message, a busy disk, another process holding the file) never stalls the
loop. Two exceptions for a store in this process (store.LocalStore, SqliteStore on a
file), each cheaper than a hop to a store thread:

- the rollout lookup reads at once on the loop (`rollout_now`: a WAL reader that waits for
  no writer and no lock, and hands the lookup to a thread when it would); it is a read of
  the last commit, never a cache, so a retried rollout's call gets its new attempt;
- span writes go to the gateway's span writer (writer.py), one thread that writes the calls
  arriving together in one transaction (group commit). Each call still returns only after
  the commit that holds its spans, and a refused call (LeaseLost) fails alone. The store numbers each attempt's spans as their writes commit (Store.append_spans),
so an attempt's calls are numbered in order however many are in flight, and however many
gateway processes serve it; nothing here keeps a count that another process could reuse.

The response id names the spans: a completion `chatcmpl-<hex>` (or `cmpl-<hex>`) records
its first choice as span `<hex>` and choice i > 0 as `<hex>-<i>`; with n > 1 each span's
response also says which choice of the call it holds (types.ChoiceOf), so credit goes only
to the choice the agent went on with (tracerl.algorithms.transitions). Agents that nest (a
planner that runs an executor sub-agent) pass that id as the sub-agent's parent; it is
stored as the sub-agent's spans' `parent_span_id`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tracerl.gateway.chat import Message, wire_message
from tracerl.gateway.errors import GatewayError
from tracerl.gateway.served import Choice
from tracerl.gateway.threads import Placement
from tracerl.gateway.tito import Prompt
from tracerl.gateway.writer import SpanWriter
from tracerl.store import LeaseLost, LocalStore, NotFound, Store, StoreError
from tracerl.types import (
    ENGINE_OUTAGE,
    UNASSISTED,
    ChoiceOf,
    Reward,
    Rollout,
    RolloutStatus,
    SamplingParams,
    Span,
)

__all__ = ["Call", "SpanRecorder", "span_ids"]

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """One served request, as its spans record it."""

    span_id: str
    """Id of the first choice's span (the response id without its prefix)."""
    role: str
    """The model name asked for."""
    parent_id: str | None
    """The span of the agent that spawned the caller, if any."""
    messages: list[Message]
    """The request's canonical messages ([] for plain completions)."""
    prompt: Prompt
    """The prompt ids and how they were built."""
    params: SamplingParams
    """How the choices were sampled."""
    latency: float
    """Seconds the engine took."""
    eos_token_ids: list[int] = field(default_factory=list)
    """The engine's end tokens (what a grammar allows once complete, for re-scoring)."""
    thread: Placement | None = None
    """The call's thread (threads.py); None for raw completions."""
    assets: dict[str, int] = field(default_factory=dict)
    """The assets in its prompt, name -> version (gateway/assets.py)."""
    unassisted: list[int] | None = None
    """The prompt's ids without its assets, when recorded (Gateway.unassisted)."""


class SpanRecorder:
    """Looks calls' rollouts up and records their spans, off the event loop."""

    def __init__(self, store: Store | None, memory: int, executor: Executor) -> None:
        self.store = store
        self.memory = memory
        """Attempts whose call memory is kept; a forgotten one is recovered from the store."""
        self._executor = executor
        self._local: LocalStore | None = store if isinstance(store, LocalStore) else None
        """The store, when it offers the fast paths (module doc)."""
        self._writer = SpanWriter(self._local) if self._local is not None else None
        """Writes the spans, grouped, when the store is local (writer.py)."""
        self._calls: OrderedDict[tuple[str, int], set[str]] = OrderedDict()
        """Per attempt, the ids of the spans this gateway recorded or found in the store:
        the parents a call of the attempt may name."""

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a store call on the store executor."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    async def rollout(self, target: str | Rollout | None) -> Rollout | None:
        """The running rollout a call belongs to: `target` itself when the caller holds it
        already (a session's, running at its last renewal), else looked up by id; 404
        unknown, 409 when not running."""
        if isinstance(target, Rollout):
            return target
        rollout_id = target
        if rollout_id is None or self.store is None:
            return None
        try:
            rollout = self._local.rollout_now(rollout_id) if self._local else None
            if rollout is None:  # not a local store, or its read would wait: a thread's job
                rollout = await self._io(self.store.get_rollout, rollout_id)
        except NotFound:
            raise GatewayError(
                404, f"unknown rollout '{rollout_id}'", code="rollout_not_found"
            ) from None
        if rollout.status != RolloutStatus.running:
            raise GatewayError(
                409,
                f"rollout '{rollout_id}' is {rollout.status.value}, not running",
                code="rollout_not_running",
            )
        return rollout

    async def parent(self, rollout: Rollout | None, value: str | None) -> str | None:
        """The span id an X-Tracerl-Parent value names; 400 when this attempt has no such call.

        The value is a response id the gateway returned (chatcmpl-..., cmpl-..., resp_...,
        msg_...) or a span id. Without a rollout nothing is recorded, so the value is not checked.
        """
        if rollout is None or value is None or not value.strip():
            return None
        value = value.strip()
        span_id = _span_id(value)
        known = self._remember(rollout)
        if span_id not in known:
            # Another gateway process may have recorded it: the store is the truth.
            known |= {s.id for s in await self._stored(rollout)}
        if span_id not in known:
            raise GatewayError(
                400,
                f"X-Tracerl-Parent '{value}' is not a call of rollout '{rollout.id}' "
                f"(attempt {rollout.attempt}); send the id of a completion this rollout "
                "received",
                param="X-Tracerl-Parent",
                code="parent_not_found",
            )
        return span_id

    async def record(self, rollout: Rollout, call: Call, choices: list[Choice]) -> None:
        """One span per choice of a call the engine served (token ids and log-probs)."""

        ordered = sorted(choices, key=lambda c: c.index)  # the store numbers them in this order
        await self._write(rollout, [_span(rollout, call, c, len(choices)) for c in ordered])

    async def outage(self, rollout: Rollout) -> None:
        """Mark `rollout`'s attempt as having met an engine outage (types.ENGINE_OUTAGE);
        an attempt already ended elsewhere keeps no mark."""
        mark = Reward(rollout_id=rollout.id, attempt=rollout.attempt, value=1.0,
                      name=ENGINE_OUTAGE)  # fmt: skip
        if self.store is not None:
            with contextlib.suppress(StoreError):
                await self._io(self.store.add_reward, mark)

    async def record_text(self, rollout: Rollout, call: Call, body: dict[str, Any]) -> None:
        """One text-only span per choice of a remote role's reply (no ids, version -1)."""
        choices = enumerate(body["choices"])
        await self._write(rollout, [_text_span(rollout, call, i, c) for i, c in choices])

    async def reward(self, rollout: Rollout, reward: Reward) -> None:
        """Record a reward the agent posted for its running attempt."""
        assert self.store is not None
        try:
            await self._io(self.store.add_reward, reward)
        except (LeaseLost, NotFound) as e:
            raise GatewayError(409, str(e), code="rollout_not_running") from None

    async def _write(self, rollout: Rollout, spans: list[Span]) -> None:
        """Append the spans (the store picks their seqs) and remember their ids. A call
        cancelled meanwhile still has its write finish on the store thread; a parent lookup
        that then misses it here finds it in the store."""
        assert self.store is not None
        try:
            if self._writer is not None:
                await self._writer.append(spans)
            else:
                await self._io(self.store.append_spans, spans)
        except LeaseLost as e:
            raise GatewayError(409, str(e), code="rollout_not_running") from None
        self._remember(rollout).update(s.id for s in spans)

    def close(self) -> None:
        """Write the spans still queued and stop the span writer."""
        if self._writer is not None:
            self._writer.close()

    def forget(self, rollout_id: str, attempt: int) -> None:
        """Drop a finished attempt's call memory."""
        self._calls.pop((rollout_id, attempt), None)

    async def _stored(self, rollout: Rollout) -> list[Span]:
        assert self.store is not None
        return await self._io(self.store.spans, rollout.id, rollout.attempt)

    def _remember(self, rollout: Rollout) -> set[str]:
        """This attempt's known span ids (a new, empty set once forgotten: `parent` then
        reads the store), the attempt made the most recently used."""
        key = (rollout.id, rollout.attempt)
        known = self._calls.pop(key, None)
        self._calls[key] = known = set() if known is None else known
        while len(self._calls) > self.memory:
            self._calls.popitem(last=False)
        return known


def _span_id(response_id: str) -> str:
    """The span a response id names, in any wire format: chatcmpl-<hex> / cmpl-<hex>
    (OpenAI chat, completions), resp_<hex> (Responses), msg_<hex> (Anthropic Messages)."""
    for prefix in ("chatcmpl-", "cmpl-", "resp_", "msg_"):
        if response_id.startswith(prefix):
            return response_id[len(prefix) :]
    return response_id


def span_ids(span_id: str, n: int) -> list[str]:
    """The spans of a call's n choices (see _choice_span)."""
    return [_choice_span(span_id, i) for i in range(n)]


def _choice_span(span_id: str, i: int) -> str:
    """Choice 0's span is `span_id` (the response id's), choice i > 0's `<span_id>-<i>`."""
    return span_id if i == 0 else f"{span_id}-{i}"


def _span(rollout: Rollout, call: Call, c: Choice, n: int) -> Span:
    """Choice `c` of `n`'s span; its seq is a placeholder the store replaces (append_spans)."""
    return Span.model_construct(
        id=_choice_span(call.span_id, c.index),
        rollout_id=rollout.id,
        attempt=rollout.attempt,
        seq=c.index,
        role=call.role,
        policy_version=c.gen.policy_version,
        prompt_ids=call.prompt.ids,
        completion_ids=c.gen.completion_ids,
        logprobs=c.gen.logprobs,
        messages=call.messages,
        response=_response(call, c, n),
        finish_reason=c.finish_reason,
        temperature=call.params.temperature,
        prefix_reused=call.prompt.reused,
        prefix_break=call.prompt.prefix_break,
        parent_span_id=call.parent_id,
        latency_s=call.latency,
        created_at=time.time(),
        thread_id=call.thread.thread_id if call.thread else None,
        parent_thread_id=call.thread.parent_thread_id if call.thread else None,
        assets=call.assets,
    )


def _response(call: Call, c: Choice, n: int) -> dict[str, Any]:
    """The reply as the span keeps it, with how the request's tools were rendered when it
    had any (tool_rendering.py); a constrained call also keeps its grammar, since its
    log-probs are those of the grammar-masked distribution (engines.scoring re-applies it),
    and one of n > 1 choices which it is (types.ChoiceOf)."""
    response: dict[str, Any] = {
        "message": wire_message(c.reply, c.call_ids),
        "finish_reason": c.finish_reason,
    }
    if n > 1:
        response["choice"] = ChoiceOf(call=call.span_id, index=c.index, of=n).model_dump()
    if call.unassisted is not None:  # the context an asset curriculum distills into
        response[UNASSISTED] = call.unassisted
    if call.prompt.tool_rendering is not None:  # how the request's tools reached the model
        response["tool_rendering"] = call.prompt.tool_rendering
    grammar = getattr(call.params, "grammar", None)
    if grammar:
        response["constraint"] = {"grammar": grammar, "eos_token_ids": call.eos_token_ids}
    return response


def _text_span(rollout: Rollout, call: Call, i: int, choice: dict[str, Any]) -> Span:
    """A remote role's choice `i` as a text-only span (seq: a placeholder, as in _span)."""
    finish = str(choice.get("finish_reason") or "stop")
    return Span(
        id=_choice_span(call.span_id, i),
        rollout_id=rollout.id,
        attempt=rollout.attempt,
        seq=i,
        role=call.role,
        policy_version=-1,
        prompt_ids=[],
        completion_ids=[],
        logprobs=[],
        messages=call.messages,
        response={"message": choice["message"], "finish_reason": finish},
        finish_reason=finish,
        temperature=call.params.temperature,
        parent_span_id=call.parent_id,
        latency_s=call.latency,
        thread_id=call.thread.thread_id if call.thread else None,
        parent_thread_id=call.thread.parent_thread_id if call.thread else None,
        assets=call.assets,
    )
