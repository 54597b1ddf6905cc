"""The engine interface: generate from token ids, take a new policy version's weights.

Small on purpose, so that a transformers engine (CPU or GPU, in process) and a vLLM engine
(servers reached over HTTP) both fit behind it. The gateway owns chat templates; an engine
sees only ids, and carries the tokenizer of its model so that the code around it (stop
strings, saving a trained model) uses exactly the one the weights were trained with. (A
role served by a remote OpenAI-compatible server speaks text, not ids, so it is no engine:
the gateway forwards it, see tracerl.gateway.remote.)

Streaming is optional: an engine with a `stream` method (`StreamingEngine`) hands out token
ids as its decode steps sample them; `stream` below falls back to `generate` for any other
engine (a remote server's), so the gateway streams from every engine the same way.

`generate` takes an optional routing key, so that an engine of several replicas keeps a
conversation on one of them; an engine that cannot serve a call now raises
EngineUnavailable, which the gateway answers with a retryable 503.

`load_state_dict` is the one weight-sync seam. An in-process engine copies the tensors and
switches between decode steps; a server engine writes them where its servers read weights
and tells them to reload; a later NCCL or IPC path sends them directly. Callers (the
pipeline's `publish`) do not change with the path.

This module stays free of torch and transformers at run time: both are named for the type
checker only.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tracerl.types import Generation, SamplingParams

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedTokenizerBase


class EngineUnavailable(RuntimeError):
    """No replica could serve a call now (its server died and no other answered); the
    caller may retry later: the gateway answers 503."""


@runtime_checkable
class Engine(Protocol):
    """A served policy.

    Threads: `generate` is awaited on the gateway's event loop and must never block it;
    `load_state_dict` is called from the trainer's thread while requests are in flight;
    `close` is called once by the owner of the process assembly (LocalStack.close).
    """

    policy_version: int
    """Version of the weights that new requests are sampled from."""
    max_context: int
    """Longest prompt + completion the engine accepts, in tokens."""
    eos_token_ids: list[int]
    """Token ids that end a completion."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer of the served model (saved beside trained weights)."""
        ...

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, routing_key: str | None = None
    ) -> Generation:
        """Sample one completion; concurrent calls are batched by the engine.

        `routing_key` names the conversation a call belongs to (the gateway passes the
        rollout id and role): an engine with several replicas sends calls with the same key
        to the same replica, whose prefix cache holds the earlier turns. One replica
        ignores it. Raises EngineUnavailable when no replica can serve the call now.
        """
        ...

    def load_state_dict(self, state: dict[str, Tensor], version: int) -> None:
        """Serve `state` (the model's parameter names -> tensors) as `version`.

        Returns once the engine holds its own copy, so the caller may keep training the
        tensors. Requests already being generated finish on the old weights and record the
        old version; requests after the switch record `version`.
        """
        ...

    def close(self) -> None:
        """Stop background work and free memory; calling it again does nothing."""
        ...


TokenStream = AsyncIterator[list[int] | Generation]
"""Lists of newly sampled token ids, in order, then the finished Generation (last, once).
The Generation's ids are the whole completion: a consumer that saw fewer takes the rest
from it."""


@runtime_checkable
class StreamingEngine(Protocol):
    """An engine that can also hand out tokens as they are sampled."""

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> TokenStream:
        """Sample one completion like `generate`, yielding its tokens as they come.

        A consumer that stops early (closes the iterator) cancels the request."""
        ...


async def stream(
    engine: Engine, prompt_ids: list[int], params: SamplingParams, routing_key: str | None = None
) -> TokenStream:
    """Tokens of one completion as `engine` samples them; engines that cannot stream (a
    server engine of replicas, routed by `routing_key`) answer with the whole Generation."""
    if isinstance(engine, StreamingEngine):
        async for item in engine.stream(prompt_ids, params):
            yield item
        return
    yield await generate_routed(engine, prompt_ids, params, routing_key)


def generate_routed(
    engine: Engine, prompt_ids: list[int], params: SamplingParams, routing_key: str | None
) -> Awaitable[Generation]:
    """`engine.generate` with `routing_key`, or without it for a duck-typed engine whose
    `generate` predates routing keys (its calls are not routed anyway)."""
    if _takes_routing_key(type(engine)):
        return engine.generate(prompt_ids, params, routing_key=routing_key)
    return engine.generate(prompt_ids, params)


@functools.cache
def _takes_routing_key(cls: type) -> bool:
    generate = getattr(cls, "generate", None)
    return generate is not None and "routing_key" in inspect.signature(generate).parameters


async def collect_stream(
    engine: Engine,
    ids: list[int],
    params: SamplingParams,
    on_tokens: Callable[[list[int]], None],
    route: str | None,
) -> Generation:
    """One completion sampled as a stream, each batch of new ids handed to `on_tokens`."""
    async for item in stream(engine, ids, params, route):
        if isinstance(item, Generation):
            return item
        on_tokens(item)
    raise RuntimeError("the engine's stream ended without a Generation")
