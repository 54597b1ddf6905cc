"""The gateway's logic, free of HTTP: route a chat or completion call to its model, build
its prompt, sample it, and hand the choices to the span recorder.

A call is attributed to a rollout (or to none, for plain serving). The prompt is built
token-in/token-out, the engine samples n choices concurrently (it batches them with every
other agent's calls), each choice becomes one Span in the store (record.py), and the reply
is parsed into OpenAI message parts.

Threads. Everything here runs on the gateway's event loop (the HTTP server's thread), and
nothing here may block it: rendering chat templates and tokenizing run on the gateway's
one tokenizer thread (one, so a tokenizer is never used by two threads at once), store calls
on its store threads and span writes on its span writer's (record.py), and sampling is awaited on the engine. What costs less
than the hop to the tokenizer thread runs inline, on the loop: the range check of a short
token-id prompt (prompting.INLINE_IDS) and a short chat's prompt (prompting.INLINE_CHARS),
the latter only while the tokenizer thread is idle, so that the tokenizer still has one user
at a time. `close` stops both executors; the HTTP server must be stopped first
(LocalStack.close does).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from tracerl.assets.config import AssetUse
from tracerl.engines.base import EngineUnavailable, collect_stream, generate_routed
from tracerl.gateway.assets import AssetContext
from tracerl.gateway.chat import ChatRequest, CompletionRequest
from tracerl.gateway.distill import StudentEncoder
from tracerl.gateway.errors import GatewayError, invalid
from tracerl.gateway.histories import Histories, text_turns
from tracerl.gateway.prompting import (
    INLINE_CHARS,
    chat_prompt,
    completion_ids,
    inline_chat,
    inline_ids,
    request_messages,
    thread_prompt,
    too_long,
    tool_dicts,
)
from tracerl.gateway.record import Call, SpanRecorder, span_ids
from tracerl.gateway.remote import RemoteError, RemoteModel
from tracerl.gateway.served import Choice, Pending, Served, ServedModel, decode
from tracerl.gateway.sessions import Record, Sessions
from tracerl.gateway.threads import Thread, place
from tracerl.gateway.tito import Prompt
from tracerl.gateway.toolcalls import parse_reply
from tracerl.gateway.toolcalls.enforce import constrained, forces_format
from tracerl.store import Store
from tracerl.types import Generation, Reward, Rollout, SamplingParams

__all__ = [
    "Choice",
    "Gateway",
    "GatewayError",
    "Pending",
    "Served",
    "ServedModel",
    "decode",
    "invalid",
]

T = TypeVar("T")

STORE_THREADS = 4
"""Store calls in flight at once (the store serialises SQLite itself; more threads let a
remote store's HTTP calls overlap)."""


class Gateway:
    """Serves calls for a set of models and records each call as a span in the store."""

    def __init__(
        self,
        store: Store | None,
        models: dict[str, ServedModel],
        memory: int = 2_048,
        remote: dict[str, RemoteModel] | None = None,
        aliases: dict[str, str] | None = None,
        default_model: str | None = None,
        record: Record = "all",
        session_idle_s: float = 300.0,
        assets: dict[str, AssetUse] | None = None,
        unassisted: Collection[str] = (),
    ) -> None:
        self.store = store
        self.models = models
        self.remote = remote or {}
        """Roles answered by OpenAI-compatible URLs elsewhere (frozen, recorded as text)."""
        self._students = {
            name: StudentEncoder(r.tokenizer, r.reply)
            for name, r in self.remote.items()
            if r.tokenizer
        }
        """Remote roles whose calls are also recorded as a local tokenizer's ids."""
        clash = sorted(set(models) & set(self.remote))
        if clash:
            raise ValueError(f"roles served both locally and remotely: {clash}")
        self.aliases = dict(aliases or {})
        """Model names clients hard-code (claude-sonnet-4-5, gpt-5, ...) -> the role serving them."""
        self.default_model = default_model
        """The role answering any other unknown name; None: unknown names get a 404."""
        named = {*self.aliases.values(), *([default_model] if default_model else [])}
        unknown = sorted(named - set(models) - set(self.remote))
        if unknown:
            raise ValueError(f"model aliases name roles nobody serves: {unknown}")
        self.store_executor = ThreadPoolExecutor(STORE_THREADS, "tracerl-store")
        """Where store calls run, the span recorder's and the /store API's."""
        self._tokenizer_thread = ThreadPoolExecutor(1, "tracerl-tokenize")
        self._last_tokenize: Future[Any] = Future()
        """The job last sent to the tokenizer thread: that thread is idle once it is done
        (one thread, jobs in order)."""
        self._last_tokenize.set_result(None)
        self.context = AssetContext(store, assets or {}, self.store_executor, memory)
        """The assets each call's prompt carries, and its seed (gateway/assets.py)."""
        self.context.check()
        self.unassisted = frozenset(unassisted)
        """Assets whose calls also record the prompt's ids without any asset (its span's
        response["unassisted_prompt_ids"]): the context a curriculum distills into."""
        self.recorder = SpanRecorder(store, memory, self.store_executor)
        self.sessions = (
            Sessions(store, self.store_executor, session_idle_s, lease_s=3 * session_idle_s)
            if store is not None and record == "all"
            else None
        )
        """Where unattributed calls are recorded; None: they are refused (record="rollouts")."""
        self.histories = Histories(memory)
        """Each rollout attempt's token histories, reused by its next calls."""
        self.memory = memory
        """Rollout attempts whose token histories and call memory are kept."""

    @property
    def names(self) -> list[str]:
        """Every model name (role) the gateway answers to, local and remote."""
        return sorted([*self.models, *self.remote])

    def close(self) -> None:
        """Finish open sessions, stop the tokenizer, span-writing and store threads (after
        the HTTP server has stopped)."""
        if self.sessions is not None:
            self.sessions.close()
        self._tokenizer_thread.shutdown(wait=True, cancel_futures=True)
        self.recorder.close()
        self.store_executor.shutdown(wait=True, cancel_futures=True)

    def role(self, name: str) -> str:
        """The role a requested model name is served by: itself, its alias, or the default."""
        if name in self.models or name in self.remote:
            return name
        return self.aliases.get(name) or self.default_model or name

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

    def check_model(self, name: str, remote: bool = False) -> None:
        """A 404 unless `name` is served (a 400 for a remote role, unless `remote`: only
        chat calls are forwarded). Routes ask first, so a call is judged on what it asks of
        a model only once that model is known."""
        role = self.role(name)
        if not (remote and role in self.remote):
            self.model(role)

    async def chat(
        self, req: ChatRequest, target: str | Rollout | None, parent: str | None = None
    ) -> Served:
        """Serve a chat completion request under `target` (a rollout id, the session rollout
        the call was attributed to, or None: not recorded; wire.rollout_of); `parent` is
        the X-Tracerl-Parent header."""
        return await self.run(await self.open_chat(req, target, parent))

    async def open_chat(
        self, req: ChatRequest, target: str | Rollout | None, parent: str | None = None
    ) -> Pending:
        """Check a chat request and build its prompt; every refusal happens here."""
        role = self.role(req.model)
        served = self.model(role)
        if broken := req.rules():
            param, why = broken
            raise GatewayError(400, why, param=param)
        rollout = await self.recorder.rollout(target)
        parent_id = await self.recorder.parent(rollout, parent)
        asked = req
        req, assets = await self.context.chat(req, role, rollout)
        span_id = uuid.uuid4().hex
        thread = None
        inline = inline_chat(req)
        unassisted = None
        if rollout is not None and not self.unassisted.isdisjoint(assets):
            _, _, plain = await self._tokenize(chat_prompt, served, asked, None, inline=inline)
            unassisted = plain.ids
        if rollout is None:
            key = None
            messages, tools, prompt = await self._tokenize(
                chat_prompt, served, req, None, inline=inline
            )
        else:
            # A sub-agent of the same role as its parent (a planner calling a planner) has
            # its own conversations: keying by parent keeps the parent's threads intact.
            key = (rollout.id, rollout.attempt, role, parent_id)
            threads, named = self._threads(rollout, parent_id)
            messages, tools, prompt, thread = await self._tokenize(
                thread_prompt, served, req, key, threads, span_id, named, inline=inline
            )
        params = self._params(served, len(prompt.ids), req.token_limit(), req)
        if forces_format(req):  # building a grammar may take long: never inline
            params = await self._tokenize(constrained, served, req, tools, params)
        return Pending(
            served, req.model, rollout, parent_id, key, thread, messages, tools, prompt, params,
            req.n, "chatcmpl", span_id, assets, unassisted,
        )  # fmt: skip

    def _threads(self, rollout: Rollout, parent_id: str | None) -> tuple[list[Thread], str | None]:
        """The attempt's threads (most recently used first) and the thread of the parent
        span a call names, for threads.place."""
        threads = self.histories.threads(rollout.id, rollout.attempt)
        return threads, self.histories.thread_of(rollout.id, rollout.attempt, parent_id)

    async def count_tokens(self, req: ChatRequest) -> int:
        """How many tokens the request's prompt holds, rendered afresh (nothing sampled)."""
        served = self.model(self.role(req.model))
        req, _ = await self.context.chat(req, served.name, None)
        _, _, prompt = await self._tokenize(chat_prompt, served, req, None)
        return len(prompt.ids)

    async def run(self, p: Pending, on_tokens: Callable[[list[int]], None] | None = None) -> Served:
        """Sample a checked call, record its spans, and return its choices. With `on_tokens`
        (one choice only), each batch of sampled ids is handed to it as it arrives."""
        started = time.perf_counter()
        route = _route(p.rollout, p.served.name)
        try:
            if on_tokens is not None and p.n == 1:
                engine = p.served.engine
                gens = [await collect_stream(engine, p.prompt.ids, p.params, on_tokens, route)]
            else:
                gens = await self._sample(p.served, p.prompt.ids, p.params, p.n, route)
        except EngineUnavailable as e:  # a replica died: the agent may retry shortly
            if p.rollout is not None:
                await self.recorder.outage(p.rollout)  # before the 503: the runner reads it
            raise GatewayError(503, str(e), "server_error", code="engine_unavailable") from None
        latency = time.perf_counter() - started
        chat = p.kind == "chatcmpl"
        choices = [self._choice(p.served, i, g, p.tools, chat) for i, g in enumerate(gens)]
        span_id = p.span_id
        if p.rollout is not None:
            if p.key is not None and p.thread is not None:
                ids = span_ids(span_id, len(choices))
                self.histories.remember(p.key, p.thread, p.messages, p.tools, p.prompt,
                                        choices, ids)  # fmt: skip
            role = p.served.name
            # What the engine's grammar allowed once complete, for re-scoring.
            engine = p.served.engine
            eos = getattr(engine, "grammar_eos_token_ids", engine.eos_token_ids)
            call = Call(span_id, role, p.parent_id, p.messages, p.prompt, p.params, latency, eos,
                        p.thread, p.assets, p.unassisted)  # fmt: skip
            await self.recorder.record(p.rollout, call, choices)
        return Served(
            id=f"{p.kind}-{span_id}",
            span_id=span_id,
            model=p.model,
            created=int(time.time()),
            choices=choices,
            prompt_tokens=len(p.prompt.ids),
            tokenizer=p.served.tokenizer,
        )

    async def chat_remote(
        self, req: ChatRequest, target: str | Rollout | None, parent: str | None = None
    ) -> dict[str, Any]:
        """Forward a chat request for a remote role; record each choice as a text-only span
        (no token ids, policy version -1), or as the ids of the role's local tokenizer when
        it names one (distill.py), and return the reply under the gateway's id."""
        role = self.role(req.model)
        remote = self.remote[role]
        rollout = await self.recorder.rollout(target)
        parent_id = await self.recorder.parent(rollout, parent)
        req, assets = await self.context.chat(req, role, rollout)
        messages = request_messages(req)
        student = self._students.get(role) if rollout is not None else None
        tools = tool_dicts(req.tools)
        prompt = Prompt([])
        span_id = uuid.uuid4().hex
        thread = key = None
        if rollout is not None:
            key = (rollout.id, rollout.attempt, role, parent_id)
            threads, named = self._threads(rollout, parent_id)
            thread = await self._tokenize(place, messages, tools, key, threads, span_id, named)
        if student is not None and thread is not None:
            prompt = await self._tokenize(student.prompts.build, messages, tools, thread.prev)
        started = time.perf_counter()
        try:
            body = await remote.chat(req.model_dump(mode="json", exclude_unset=True))
        except RemoteError as e:
            raise GatewayError(e.status, e.message, "server_error", code=e.code) from None
        latency = time.perf_counter() - started
        if rollout is not None and key is not None and thread is not None:
            params = SamplingParams(temperature=req.temperature)
            call = Call(span_id, role, parent_id, messages, prompt, params, latency, [], thread,
                        assets)  # fmt: skip
            ids = span_ids(span_id, len(body["choices"]))
            if student is None:
                turns, pending = text_turns(body)
                self.histories.remember_turns(key, thread, messages, tools, turns, pending, ids)
                await self.recorder.record_text(rollout, call, body)
            else:
                choices = await self._tokenize(student.choices, messages, tools, body)
                self.histories.remember(key, thread, messages, tools, prompt, choices, ids)
                await self.recorder.record(rollout, call, choices)
        return {**body, "id": f"chatcmpl-{span_id}", "model": req.model}

    async def complete(
        self, req: CompletionRequest, target: str | Rollout | None, parent: str | None = None
    ) -> Served:
        """Serve a raw text completion request; `parent` is the X-Tracerl-Parent header."""
        return await self.run(await self.open_complete(req, target, parent))

    async def open_complete(
        self, req: CompletionRequest, target: str | Rollout | None, parent: str | None = None
    ) -> Pending:
        """Check a raw completion request and tokenize its prompt."""
        served = self.model(self.role(req.model))
        rollout = await self.recorder.rollout(target)
        parent_id = await self.recorder.parent(rollout, parent)
        req = await self.context.completion(req, rollout)
        if inline_ids(req.prompt):  # a short id list: checked here, no thread hop
            ids = completion_ids(served, req.prompt)
        else:
            short = isinstance(req.prompt, str) and len(req.prompt) <= INLINE_CHARS
            ids = await self._tokenize(completion_ids, served, req.prompt, inline=short)
        params = self._params(served, len(ids), req.max_tokens, req)
        return Pending(
            served, req.model, rollout, parent_id, None, None, [], None, Prompt(ids=ids), params,
            req.n, "cmpl", uuid.uuid4().hex,
        )  # fmt: skip

    async def reward(
        self,
        rollout_id: str,
        value: float,
        span_seq: int | None = None,
        role: str | None = None,
        name: str = "reward",
    ) -> None:
        """Record a reward for the running attempt of `rollout_id` (see RewardRequest)."""
        rollout = await self.recorder.rollout(rollout_id)
        if rollout is None:
            raise GatewayError(400, "this gateway records no rollouts (it has no store)")
        reward = Reward(
            rollout_id=rollout.id,
            attempt=rollout.attempt,
            value=value,
            span_seq=span_seq,
            role=role,
            name=name,
        )
        await self.recorder.reward(rollout, reward)

    async def _tokenize(self, fn: Callable[..., T], *args: Any, inline: bool = False) -> T:
        """Run template rendering / tokenization on the gateway's tokenizer thread; with
        `inline` (a job that costs less than the hop), on the loop instead when that thread
        is idle, so the tokenizer is never used by two threads at once."""
        if inline and self._last_tokenize.done():
            return fn(*args)
        job = self._tokenizer_thread.submit(fn, *args)
        self._last_tokenize = job
        return await asyncio.wrap_future(job)

    def _params(
        self,
        served: ServedModel,
        prompt_len: int,
        limit: int | None,
        req: ChatRequest | CompletionRequest,
    ) -> SamplingParams:
        room = served.engine.max_context - prompt_len
        if room < 1:
            param = "messages" if isinstance(req, ChatRequest) else "prompt"
            raise too_long(prompt_len, served.engine.max_context, param)
        return SamplingParams(
            max_tokens=min(limit or served.default_max_tokens, room),
            temperature=req.temperature,
            top_p=req.top_p,
            stop=req.stop_list(),
            seed=req.seed,
            top_logprobs=_alternatives(req),
        )

    async def _sample(
        self, served: ServedModel, ids: list[int], params: SamplingParams, n: int, route: str | None
    ) -> list[Generation]:
        """n completions; `route` keeps a rollout's calls on one engine replica."""
        seeded = [
            params if params.seed is None else params.model_copy(update={"seed": params.seed + i})
            for i in range(n)
        ]
        if n == 1:
            return [await generate_routed(served.engine, ids, params, route)]
        calls = (generate_routed(served.engine, ids, p, route) for p in seeded)
        return list(await asyncio.gather(*calls))

    def _choice(
        self, served: ServedModel, index: int, gen: Generation, tools: list[dict] | None, chat: bool
    ) -> Choice:
        text = served.text(gen)
        reasoning = served.reasoning if chat else None  # a raw completion's text stays whole
        reply = parse_reply(text, tools, served.tool_format, reasoning)
        call_ids = [f"call_{uuid.uuid4().hex[:16]}" for _ in reply.tool_calls]
        finish = "tool_calls" if reply.tool_calls else gen.finish_reason
        return Choice(index, gen, text, reply, call_ids, finish)

    def finished(self, rollout: Rollout) -> None:
        """Drop what the gateway remembers of a finished attempt: no call of it follows."""
        self.histories.forget(rollout.id, rollout.attempt)
        self.recorder.forget(rollout.id, rollout.attempt)
        self.context.forget(rollout.id, rollout.attempt)


def _alternatives(req: ChatRequest | CompletionRequest) -> int:
    """How many most likely tokens per position the call asks for (chat: with logprobs)."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else 0
    return req.logprobs or 0


def _route(rollout: Rollout | None, role: str) -> str | None:
    """The routing key of a call: its rollout and role (None outside a rollout)."""
    return f"{rollout.id}/{role}" if rollout is not None else None
