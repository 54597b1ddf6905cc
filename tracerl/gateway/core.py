"""The gateway's logic, free of HTTP: serve a chat or completion call and record its span.

A call is attributed to a rollout (or to none, for plain serving). The prompt is built
token-in/token-out, the engine samples n choices concurrently (it batches them with every
other agent's calls), each choice becomes one Span in the store, and the reply is parsed
into OpenAI message parts.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

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
    """Response id (chatcmpl-... / cmpl-...)."""
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
        self, store: Store | None, models: dict[str, ServedModel], memory: int = 100_000
    ) -> None:
        self.store = store
        self.models = models
        # Per-rollout memory, bounded: the oldest entries go first. A forgotten history only
        # costs a re-tokenization (recorded as a prefix break); a forgotten call counter is
        # recovered from the store.
        self._histories: OrderedDict[tuple[str, int, str], History] = OrderedDict()
        self._seq: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.memory = memory

    def model(self, name: str) -> ServedModel:
        """The served model called `name`, or a 404."""
        served = self.models.get(name)
        if served is None:
            known = ", ".join(sorted(self.models))
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

    async def chat(self, req: ChatRequest, rollout_id: str | None) -> Served:
        """Serve a chat completion request."""
        served = self.model(req.model)
        rollout = self.rollout(rollout_id)
        try:
            messages = [normalize_message(m) for m in req.messages]
        except (ValueError, TypeError, AttributeError) as e:
            raise GatewayError(400, str(e), param="messages") from None
        tools = _tool_dicts(req.tools)
        key = (rollout.id, rollout.attempt, req.model) if rollout else None
        prompt = self._prompt(served, messages, tools, key)
        params = self._params(served, len(prompt.ids), req.token_limit(), req)
        started = time.perf_counter()
        gens = await self._sample(served, prompt.ids, params, req.n)
        latency = time.perf_counter() - started
        choices = [self._choice(served, i, g, tools is not None) for i, g in enumerate(gens)]
        if rollout is not None and key is not None:
            self._remember(key, messages, tools, prompt, choices)
            self._record(rollout, req.model, messages, prompt, choices, params, latency)
        return Served(
            id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
            model=req.model,
            created=int(time.time()),
            choices=choices,
            prompt_tokens=len(prompt.ids),
            tokenizer=served.tokenizer,
        )

    async def complete(self, req: CompletionRequest, rollout_id: str | None) -> Served:
        """Serve a raw text completion request."""
        served = self.model(req.model)
        rollout = self.rollout(rollout_id)
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
        if rollout is not None:
            self._record(rollout, req.model, [], prompt, choices, params, latency)
        return Served(
            id=f"cmpl-{uuid.uuid4().hex[:24]}",
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
        key: tuple[str, int, str] | None,
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
        key: tuple[str, int, str],
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

    def _record(
        self,
        rollout: Rollout,
        role: str,
        messages: list[Message],
        prompt: Prompt,
        choices: list[Choice],
        params: SamplingParams,
        latency: float,
    ) -> None:
        assert self.store is not None
        spans = []
        key = (rollout.id, rollout.attempt)
        if key not in self._seq:
            self._seq[key] = len(self.store.spans(rollout.id, rollout.attempt))
            while len(self._seq) > self.memory:
                self._seq.popitem(last=False)
        for c in choices:
            seq = self._seq[key]
            self._seq[key] = seq + 1
            spans.append(
                Span.model_construct(
                    id=uuid.uuid4().hex,
                    rollout_id=rollout.id,
                    attempt=rollout.attempt,
                    seq=seq,
                    role=role,
                    policy_version=c.gen.policy_version,
                    prompt_ids=prompt.ids,
                    completion_ids=c.gen.completion_ids,
                    logprobs=c.gen.logprobs,
                    messages=messages,
                    response={
                        "message": wire_message(c.reply, c.call_ids),
                        "finish_reason": c.finish_reason,
                    },
                    finish_reason=c.finish_reason,
                    temperature=params.temperature,
                    prefix_reused=prompt.reused,
                    prefix_break=prompt.prefix_break,
                    parent_span_id=None,
                    latency_s=latency,
                    created_at=time.time(),
                )
            )
        try:
            self.store.add_spans(spans)
        except LeaseLost as e:
            raise GatewayError(409, str(e), code="rollout_not_running") from None


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special: bool) -> str:
    """Text of ids (the tokenizer's stubs allow a list; one sequence gives a string)."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special)
    assert isinstance(text, str)
    return text


def _end(gen: Generation) -> str:
    if gen.stop_string:
        return "stop_string"
    return "eos" if gen.finish_reason == "stop" else "length"


def _tool_dicts(tools: list[ToolSpec] | None) -> list[dict] | None:
    """Tools as plain dicts for the chat template (None when absent or empty)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None
