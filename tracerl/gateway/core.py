"""The gateway's logic, free of HTTP: serve a chat or completion call and record its span.

A call is attributed to a rollout (or to none, for plain serving). The prompt is built
token-in/token-out, the engine samples n choices concurrently (it batches them with every
other agent's calls), each choice becomes one Span in the store, and the reply is parsed
into OpenAI message parts.

The response id names the spans: a completion `chatcmpl-<hex>` (or `cmpl-<hex>`) records
its first choice as span `<hex>` and choice i > 0 as `<hex>-<i>`. Agents that nest (a
planner that runs an executor sub-agent) pass that id as the sub-agent's parent; it is
stored as the sub-agent's spans' `parent_span_id`.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from tracerl.engines.base import Engine
from tracerl.gateway.chat import (
    ChatRequest,
    CompletionRequest,
    Message,
    ParsedReply,
    ToolSpec,
    canonical_reply,
    normalize_message,
    parse_reply,
    wire_message,
)
from tracerl.gateway.remote import RemoteError, RemoteModel
from tracerl.gateway.tito import History, Prompt, PromptBuilder, Turn
from tracerl.store import LeaseLost, NotFound, Store
from tracerl.types import Generation, Rollout, RolloutStatus, SamplingParams, Span


class GatewayError(Exception):
    """A request the gateway refuses, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )


def invalid(e: ValidationError) -> GatewayError:
    """A pydantic validation failure as a 400 naming the first offending field."""
    err = e.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    return GatewayError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param)


@dataclass
class ServedModel:
    """A model name the gateway answers to, with its engine and tokenizer."""

    name: str
    """The `model` agents ask for; also the role recorded on spans."""
    engine: Engine
    """What samples completions."""
    tokenizer: PreTrainedTokenizerBase
    """Tokenizer with the chat template of the engine's model."""
    default_max_tokens: int = 512
    """max_tokens when a request gives none (still capped by the context)."""
    prompts: PromptBuilder = field(init=False)
    _special: re.Pattern[str] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.prompts = PromptBuilder(self.tokenizer)
        # Special tokens other than the tool-call markers never reach the agent's text.
        hidden = [t for t in self.tokenizer.all_special_tokens if "tool_call" not in t]
        if hidden:
            self._special = re.compile("|".join(re.escape(t) for t in hidden))

    def text(self, gen: Generation) -> str:
        """The completion's text as the agent sees it (no end token, no stop string)."""
        text = decode(self.tokenizer, gen.completion_ids, skip_special=False)
        if gen.stop_string:
            at = text.find(gen.stop_string)
            text = text[:at] if at >= 0 else text
        return self._special.sub("", text) if self._special else text


@dataclass
class _Calls:
    """What the gateway remembers of one rollout attempt's recorded calls."""

    next_seq: int
    """Seq of the next span."""
    span_ids: set[str]
    """Ids of the spans recorded so far: the parents a call of this attempt may name."""


HistoryKey = tuple[str, int, str, str | None]
"""(rollout id, attempt, role, parent span id): one agent's conversation with one model."""


@dataclass
class Choice:
    """One sampled choice, ready to be written in any wire format."""

    index: int
    """Position among the request's n choices."""
    gen: Generation
    """What the engine sampled."""
    text: str
    """Decoded completion text (raw, before tool-call parsing)."""
    reply: ParsedReply
    """Content and tool calls parsed from the text."""
    call_ids: list[str]
    """Ids given to the parsed tool calls."""
    finish_reason: str
    """OpenAI finish reason: stop, length or tool_calls."""


@dataclass
class Served:
    """The outcome of one call: its choices and token counts."""

    id: str
    """Response id: chatcmpl-<span id> / cmpl-<span id> (the first choice's span)."""
    model: str
    """Model name that answered."""
    created: int
    """Unix time."""
    choices: list[Choice]
    """The n choices."""
    prompt_tokens: int
    """Prompt length in tokens."""
    tokenizer: PreTrainedTokenizerBase
    """For per-token text in logprobs and streaming."""

    @property
    def completion_tokens(self) -> int:
        """Sampled tokens over all choices."""
        return sum(len(c.gen.completion_ids) for c in self.choices)


class Gateway:
    """Serves calls for a set of models and records each call as a span in the store."""

    def __init__(
        self,
        store: Store | None,
        models: dict[str, ServedModel],
        memory: int = 100_000,
        remote: dict[str, RemoteModel] | None = None,
    ) -> None:
        self.store = store
        self.models = models
        self.remote = remote or {}
        """Roles answered by OpenAI-compatible URLs elsewhere (frozen, recorded as text)."""
        clash = sorted(set(models) & set(self.remote))
        if clash:
            raise ValueError(f"roles served both locally and remotely: {clash}")
        # Per-rollout memory, bounded: the oldest entries go first. A forgotten history only
        # costs a re-tokenization (recorded as a prefix break); a forgotten call counter is
        # recovered from the store.
        self._histories: OrderedDict[HistoryKey, History] = OrderedDict()
        self._calls: OrderedDict[tuple[str, int], _Calls] = OrderedDict()
        self.memory = memory

    @property
    def names(self) -> list[str]:
        """Every model name (role) the gateway answers to, local and remote."""
        return sorted([*self.models, *self.remote])

    def model(self, name: str) -> ServedModel:
        """The served model called `name`, or a 404 (a 400 for a remote role's raw
        completion: only chat requests are forwarded)."""
        served = self.models.get(name)
        if served is None and name in self.remote:
            raise GatewayError(
                400,
                f"The model '{name}' is served by {self.remote[name].url}; "
                "send it chat completions (/v1/chat/completions)",
                param="model",
                code="remote_chat_only",
            )
        if served is None:
            known = ", ".join(self.names)
            raise GatewayError(
                404,
                f"The model '{name}' does not exist; served models: {known}",
                param="model",
                code="model_not_found",
            )
        return served

    def rollout(self, rollout_id: str | None) -> Rollout | None:
        """The running rollout a call belongs to; 404 unknown, 409 when not running."""
        if rollout_id is None or self.store is None:
            return None
        try:
            rollout = self.store.get_rollout(rollout_id)
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

    def parent(self, rollout: Rollout | None, value: str | None) -> str | None:
        """The span id an X-Tracerl-Parent value names; 400 when this attempt has no such call.

        The value is a completion id the gateway returned (chatcmpl-..., cmpl-...) or a span
        id. Without a rollout nothing is recorded, so the value is not checked.
        """
        if rollout is None or value is None or not value.strip():
            return None
        value = value.strip()
        span_id = value.removeprefix("chatcmpl-").removeprefix("cmpl-")
        calls = self._attempt_calls(rollout)
        if span_id not in calls.span_ids:
            # Another gateway process may have recorded it: the store is the truth.
            calls.span_ids |= {s.id for s in self._stored(rollout)}
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

    async def chat(
        self, req: ChatRequest, rollout_id: str | None, parent: str | None = None
    ) -> Served:
        """Serve a chat completion request; `parent` is the X-Tracerl-Parent header."""
        served = self.model(req.model)
        rollout = self.rollout(rollout_id)
        parent_id = self.parent(rollout, parent)
        messages = _messages(req)
        tools = _tool_dicts(req.tools)
        # A sub-agent of the same role as its parent (a planner calling a planner) has its
        # own conversation: keying by parent keeps the parent's token history intact.
        key = (rollout.id, rollout.attempt, req.model, parent_id) if rollout else None
        prompt = self._prompt(served, messages, tools, key)
        params = self._params(served, len(prompt.ids), req.token_limit(), req)
        started = time.perf_counter()
        gens = await self._sample(served, prompt.ids, params, req.n)
        latency = time.perf_counter() - started
        choices = [self._choice(served, i, g, tools is not None) for i, g in enumerate(gens)]
        span_id = uuid.uuid4().hex
        if rollout is not None and key is not None:
            self._remember(key, messages, tools, prompt, choices)
            call = _Call(span_id, req.model, parent_id, messages, prompt, params, latency)
            self._record(rollout, call, choices)
        return Served(
            id=f"chatcmpl-{span_id}",
            model=req.model,
            created=int(time.time()),
            choices=choices,
            prompt_tokens=len(prompt.ids),
            tokenizer=served.tokenizer,
        )

    async def chat_remote(
        self, req: ChatRequest, rollout_id: str | None, parent: str | None = None
    ) -> dict[str, Any]:
        """Forward a chat request for a remote role; record each choice as a text-only span
        (no token ids, policy version -1) and return the reply under the gateway's id."""
        remote = self.remote[req.model]
        rollout = self.rollout(rollout_id)
        parent_id = self.parent(rollout, parent)
        messages = _messages(req)
        started = time.perf_counter()
        try:
            body = await remote.chat(req.model_dump(mode="json", exclude_unset=True))
        except RemoteError as e:
            raise GatewayError(e.status, e.message, "server_error", code=e.code) from None
        latency = time.perf_counter() - started
        span_id = uuid.uuid4().hex
        if rollout is not None:
            self._record_text(rollout, span_id, req, parent_id, messages, body, latency)
        return {**body, "id": f"chatcmpl-{span_id}", "model": req.model}

    def _record_text(
        self,
        rollout: Rollout,
        span_id: str,
        req: ChatRequest,
        parent_id: str | None,
        messages: list[Message],
        body: dict[str, Any],
        latency: float,
    ) -> None:
        calls = self._attempt_calls(rollout)
        spans = []
        for i, choice in enumerate(body["choices"]):
            finish = str(choice.get("finish_reason") or "stop")
            spans.append(
                Span(
                    id=span_id if i == 0 else f"{span_id}-{i}",
                    rollout_id=rollout.id,
                    attempt=rollout.attempt,
                    seq=calls.next_seq + i,
                    role=req.model,
                    policy_version=-1,
                    prompt_ids=[],
                    completion_ids=[],
                    logprobs=[],
                    messages=messages,
                    response={"message": choice["message"], "finish_reason": finish},
                    finish_reason=finish,
                    temperature=req.temperature,
                    parent_span_id=parent_id,
                    latency_s=latency,
                )
            )
        self._store_spans(calls, spans)

    async def complete(
        self, req: CompletionRequest, rollout_id: str | None, parent: str | None = None
    ) -> Served:
        """Serve a raw text completion request; `parent` is the X-Tracerl-Parent header."""
        served = self.model(req.model)
        rollout = self.rollout(rollout_id)
        parent_id = self.parent(rollout, parent)
        if isinstance(req.prompt, str):
            ids = list(served.tokenizer.encode(req.prompt))
        else:
            ids = list(req.prompt)
            vocab = len(served.tokenizer)
            if any(not 0 <= t < vocab for t in ids):
                raise GatewayError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        if not ids:
            raise GatewayError(400, "prompt is empty", param="prompt")
        prompt = Prompt(ids=ids)
        params = self._params(served, len(ids), req.max_tokens, req)
        started = time.perf_counter()
        gens = await self._sample(served, ids, params, req.n)
        latency = time.perf_counter() - started
        choices = [self._choice(served, i, g, False) for i, g in enumerate(gens)]
        span_id = uuid.uuid4().hex
        if rollout is not None:
            call = _Call(span_id, req.model, parent_id, [], prompt, params, latency)
            self._record(rollout, call, choices)
        return Served(
            id=f"cmpl-{span_id}",
            model=req.model,
            created=int(time.time()),
            choices=choices,
            prompt_tokens=len(ids),
            tokenizer=served.tokenizer,
        )

    def _prompt(
        self,
        served: ServedModel,
        messages: list[Message],
        tools: list[dict] | None,
        key: HistoryKey | None,
    ) -> Prompt:
        prev = self._histories.get(key) if key else None
        try:
            return served.prompts.build(messages, tools, prev)
        except GatewayError:
            raise
        except Exception as e:  # a template that cannot render this conversation
            raise GatewayError(400, f"cannot render messages: {e}", param="messages") from None

    def _params(
        self,
        served: ServedModel,
        prompt_len: int,
        limit: int | None,
        req: ChatRequest | CompletionRequest,
    ) -> SamplingParams:
        room = served.engine.max_context - prompt_len
        if room < 1:
            raise GatewayError(
                400,
                f"This model's maximum context length is {served.engine.max_context} tokens; "
                f"the prompt holds {prompt_len}.",
                param="messages",
                code="context_length_exceeded",
            )
        return SamplingParams(
            max_tokens=min(limit or served.default_max_tokens, room),
            temperature=req.temperature,
            top_p=req.top_p,
            stop=req.stop_list(),
            seed=req.seed,
        )

    async def _sample(
        self, served: ServedModel, ids: list[int], params: SamplingParams, n: int
    ) -> list[Generation]:
        if n == 1:
            return [await served.engine.generate(ids, params)]
        seeded = [
            params if params.seed is None else params.model_copy(update={"seed": params.seed + i})
            for i in range(n)
        ]
        return list(await asyncio.gather(*(served.engine.generate(ids, p) for p in seeded)))

    def _choice(self, served: ServedModel, index: int, gen: Generation, tools: bool) -> Choice:
        text = served.text(gen)
        reply = parse_reply(text, tools)
        call_ids = [f"call_{uuid.uuid4().hex[:16]}" for _ in reply.tool_calls]
        finish = "tool_calls" if reply.tool_calls else gen.finish_reason
        return Choice(index, gen, text, reply, call_ids, finish)

    def _remember(
        self,
        key: HistoryKey,
        messages: list[Message],
        tools: list[dict] | None,
        prompt: Prompt,
        choices: list[Choice],
    ) -> None:
        turns = [
            Turn(
                ids=prompt.ids + c.gen.completion_ids,
                reply=canonical_reply(c.reply, c.call_ids),
                end=_end(c.gen),
            )
            for c in choices
        ]
        self._histories[key] = History(messages=messages, tools=tools, turns=turns)
        self._histories.move_to_end(key)
        while len(self._histories) > self.memory:
            self._histories.popitem(last=False)

    def _stored(self, rollout: Rollout) -> list[Span]:
        assert self.store is not None
        return self.store.spans(rollout.id, rollout.attempt)

    def _attempt_calls(self, rollout: Rollout) -> _Calls:
        """This attempt's call memory; recovered from the store once forgotten."""
        key = (rollout.id, rollout.attempt)
        calls = self._calls.get(key)
        if calls is None:
            spans = self._stored(rollout)
            calls = _Calls(next_seq=len(spans), span_ids={s.id for s in spans})
            self._calls[key] = calls
            while len(self._calls) > self.memory:
                self._calls.popitem(last=False)
        return calls

    def _record(self, rollout: Rollout, call: _Call, choices: list[Choice]) -> None:
        assert self.store is not None
        calls = self._attempt_calls(rollout)
        spans = []
        for c in choices:
            spans.append(
                Span.model_construct(
                    id=call.span_id if c.index == 0 else f"{call.span_id}-{c.index}",
                    rollout_id=rollout.id,
                    attempt=rollout.attempt,
                    seq=calls.next_seq + c.index,
                    role=call.role,
                    policy_version=c.gen.policy_version,
                    prompt_ids=call.prompt.ids,
                    completion_ids=c.gen.completion_ids,
                    logprobs=c.gen.logprobs,
                    messages=call.messages,
                    response={
                        "message": wire_message(c.reply, c.call_ids),
                        "finish_reason": c.finish_reason,
                    },
                    finish_reason=c.finish_reason,
                    temperature=call.params.temperature,
                    prefix_reused=call.prompt.reused,
                    prefix_break=call.prompt.prefix_break,
                    parent_span_id=call.parent_id,
                    latency_s=call.latency,
                    created_at=time.time(),
                )
            )
        self._store_spans(calls, spans)

    def _store_spans(self, calls: _Calls, spans: list[Span]) -> None:
        assert self.store is not None
        try:
            self.store.add_spans(spans)
        except LeaseLost as e:
            raise GatewayError(409, str(e), code="rollout_not_running") from None
        calls.next_seq += len(spans)
        calls.span_ids.update(s.id for s in spans)


@dataclass(frozen=True)
class _Call:
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


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special: bool) -> str:
    """Text of ids (the tokenizer's stubs allow a list; one sequence gives a string)."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special)
    assert isinstance(text, str)
    return text


def _end(gen: Generation) -> str:
    if gen.stop_string:
        return "stop_string"
    return "eos" if gen.finish_reason == "stop" else "length"


def _messages(req: ChatRequest) -> list[Message]:
    """The request's messages in one form, or a 400 naming what is wrong with them."""
    try:
        return [normalize_message(m) for m in req.messages]
    except (ValueError, TypeError, AttributeError) as e:
        raise GatewayError(400, str(e), param="messages") from None


def _tool_dicts(tools: list[ToolSpec] | None) -> list[dict] | None:
    """Tools as plain dicts for the chat template (None when absent or empty)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None
