"""Attribution and span recording: which rollout attempt a call belongs to, and its spans.

The gateway's event loop never calls the store itself: every store call (rollout lookup,
parent check, span and reward writes) runs on the gateway's store executor, so a slow
write (a 10 MB message, a busy disk, another process holding the file) never stalls the
loop. Span seqs are handed out under a per-attempt asyncio lock held across the write, so
an attempt's spans are numbered in the order they commit, however many of its calls are
in flight; writes of different attempts run side by side.

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
from tracerl.gateway.tito import Prompt
from tracerl.store import LeaseLost, NotFound, Store, StoreError
from tracerl.types import (
    ENGINE_OUTAGE,
    ChoiceOf,
    Reward,
    Rollout,
    RolloutStatus,
    SamplingParams,
    Span,
)

__all__ = ["Call", "SpanRecorder"]

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


@dataclass
class _Calls:
    """What the gateway remembers of one rollout attempt's recorded calls."""

    next_seq: int
    """Seq of the next span."""
    span_ids: set[str]
    """Ids of the spans recorded so far: the parents a call of this attempt may name."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held from choosing seqs until their write commits, so seqs follow commit order."""


class SpanRecorder:
    """Looks calls' rollouts up and records their spans, off the event loop."""

    def __init__(self, store: Store | None, memory: int, executor: Executor) -> None:
        self.store = store
        self.memory = memory
        """Attempts whose call memory is kept; a forgotten one is recovered from the store."""
        self._executor = executor
        self._calls: OrderedDict[tuple[str, int], _Calls] = OrderedDict()

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
        calls = await self._attempt_calls(rollout)
        if span_id not in calls.span_ids:
            # Another gateway process may have recorded it: the store is the truth.
            calls.span_ids |= {s.id for s in await self._stored(rollout)}
        if span_id not in calls.span_ids:
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

        def spans(seq: int) -> list[Span]:
            return [_span(rollout, call, c, seq + c.index, len(choices)) for c in choices]

        await self._write(rollout, spans)

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

        def spans(seq: int) -> list[Span]:
            return [_text_span(rollout, call, i, c, seq) for i, c in enumerate(body["choices"])]

        await self._write(rollout, spans)

    async def reward(self, rollout: Rollout, reward: Reward) -> None:
        """Record a reward the agent posted for its running attempt."""
        assert self.store is not None
        try:
            await self._io(self.store.add_reward, reward)
        except (LeaseLost, NotFound) as e:
            raise GatewayError(409, str(e), code="rollout_not_running") from None

    async def _write(self, rollout: Rollout, spans: Callable[[int], list[Span]]) -> None:
        # Shielded: a call cancelled (its client gone) once its spans are being written
        # still finishes the write and the seq bookkeeping, or the next call of the attempt
        # would reuse a seq the store already holds.
        await asyncio.shield(self._write_numbered(rollout, spans))

    async def _write_numbered(self, rollout: Rollout, spans: Callable[[int], list[Span]]) -> None:
        assert self.store is not None
        calls = await self._attempt_calls(rollout)
        async with calls.lock:
            batch = spans(calls.next_seq)
            try:
                await self._io(self.store.add_spans, batch)
            except LeaseLost as e:
                raise GatewayError(409, str(e), code="rollout_not_running") from None
            calls.next_seq += len(batch)
            calls.span_ids.update(s.id for s in batch)

    def forget(self, rollout_id: str, attempt: int) -> None:
        """Drop a finished attempt's call memory."""
        self._calls.pop((rollout_id, attempt), None)

    async def _stored(self, rollout: Rollout) -> list[Span]:
        assert self.store is not None
        return await self._io(self.store.spans, rollout.id, rollout.attempt)

    async def _attempt_calls(self, rollout: Rollout) -> _Calls:
        """This attempt's call memory; recovered from the store once forgotten."""
        key = (rollout.id, rollout.attempt)
        calls = self._calls.get(key)
        if calls is not None:
            return calls
        spans = await self._stored(rollout)
        calls = self._calls.get(key)  # another call may have recovered it meanwhile
        if calls is None:
            calls = _Calls(next_seq=len(spans), span_ids={s.id for s in spans})
            self._calls[key] = calls
            while len(self._calls) > self.memory:
                self._calls.popitem(last=False)
        return calls


def _span_id(response_id: str) -> str:
    """The span a response id names, in any wire format: chatcmpl-<hex> / cmpl-<hex>
    (OpenAI chat, completions), resp_<hex> (Responses), msg_<hex> (Anthropic Messages)."""
    for prefix in ("chatcmpl-", "cmpl-", "resp_", "msg_"):
        if response_id.startswith(prefix):
            return response_id[len(prefix) :]
    return response_id


def _span(rollout: Rollout, call: Call, c: Choice, seq: int, n: int) -> Span:
    return Span.model_construct(
        id=call.span_id if c.index == 0 else f"{call.span_id}-{c.index}",
        rollout_id=rollout.id,
        attempt=rollout.attempt,
        seq=seq,
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
    )


def _response(call: Call, c: Choice, n: int) -> dict[str, Any]:
    """The reply as the span keeps it; a constrained call also keeps its grammar, since its
    log-probs are those of the grammar-masked distribution (engines.scoring re-applies it),
    and one of n > 1 choices which it is (types.ChoiceOf)."""
    response: dict[str, Any] = {
        "message": wire_message(c.reply, c.call_ids),
        "finish_reason": c.finish_reason,
    }
    if n > 1:
        response["choice"] = ChoiceOf(call=call.span_id, index=c.index, of=n).model_dump()
    grammar = getattr(call.params, "grammar", None)
    if grammar:
        response["constraint"] = {"grammar": grammar, "eos_token_ids": call.eos_token_ids}
    return response


def _text_span(rollout: Rollout, call: Call, i: int, choice: dict[str, Any], seq: int) -> Span:
    finish = str(choice.get("finish_reason") or "stop")
    return Span(
        id=call.span_id if i == 0 else f"{call.span_id}-{i}",
        rollout_id=rollout.id,
        attempt=rollout.attempt,
        seq=seq + i,
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
    )
