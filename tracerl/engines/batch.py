"""The running batch of the transformers engine: its rows, its KV cache, and their surgery.

HFEngine (hf.py) decides when to admit, step and retire; this module holds what those
steps work on (and the counters they keep, EngineStats). A batch is B left-padded rows sharing one DynamicCache of L columns. Rows
that finish leave it (`select`), rows prefilled later join it (`merge`), and columns that
became padding in every row are cut (`trim_left`), so a long row that left does not keep
costing attention. Sampling (`sample`) picks each row's token with the row's own seeded
generator and records its log-prob at the row's temperature.

Also here: a request's hand-off back to the caller's event loop (`deliver`, and for a
streaming request `notify` per token, read by `relay`), since the worker thread must never
touch an asyncio future or queue directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from tracerl.engines.constrained import Matcher, masked
from tracerl.engines.scoring import effective_temperature, logprobs_at_temperature
from tracerl.types import Generation, SamplingParams

__all__ = [
    "Batch",
    "EngineStats",
    "Request",
    "Row",
    "check_request",
    "deliver",
    "joinable",
    "left_padded",
    "merge",
    "new_row",
    "notify",
    "relay",
    "sample",
    "select",
]


class EngineStats(BaseModel):
    """What an HFEngine has done since it started; `HFEngine.stats` hands out copies."""

    model_config = ConfigDict(extra="forbid")

    batches: int = 0
    """Prefill forward passes; each admits every request waiting at that moment."""
    decode_steps: int = 0
    """Decode forward passes (one new token for every running row)."""
    requests: int = 0
    """Requests answered, with a Generation or an error."""
    tokens: int = 0
    """Completion tokens sampled."""
    peak_rows: int = 0
    """Most rows that ran together in one batch."""
    running_rows: int = 0
    """Rows in the running batch now."""
    weight_swaps: int = 0
    """Times new weights were switched in."""


@dataclass
class Request:
    """One `generate` call waiting for the worker."""

    prompt_ids: list[int]
    """The prompt, as the gateway built it."""
    params: SamplingParams
    """How to sample it."""
    future: asyncio.Future[Generation]
    """Settled on `loop` with the Generation or the error."""
    loop: asyncio.AbstractEventLoop
    """The caller's event loop (the gateway's)."""
    tokens: asyncio.Queue[int | asyncio.Future[Generation]] | None = None
    """For a streaming request: each sampled token id, then the settled future (on `loop`)."""


@dataclass
class Row:
    """A request being decoded: its sampler and what it has produced so far."""

    request: Request
    """The call this row answers."""
    generator: torch.Generator
    """The row's own sampler, seeded per request, so batching never changes a draw."""
    budget: int
    """Most tokens it may sample: max_tokens, capped by max_context."""
    version: int
    """Version of the weights decoding it."""
    stops: list[str]
    """Stop strings of the request (empty ones dropped)."""
    stop_window: int
    """How many trailing tokens to decode to see any stop string whole."""
    completion_ids: list[int] = field(default_factory=list)
    """Tokens sampled so far."""
    logprobs: list[float] = field(default_factory=list)
    """Their log-probs at the row's temperature (under its grammar's mask, if any)."""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """At each of them, the params.top_logprobs most likely (id, log-prob) of that same
    distribution; empty when none were asked for."""
    matcher: Matcher | None = None
    """The request's grammar state, for a constrained request (constrained.py)."""


@dataclass
class Batch:
    """The running rows and their shared KV cache (B rows, L cached columns)."""

    rows: list[Row]
    """One per running request, in cache order."""
    cache: DynamicCache
    """Keys and values of every cached column."""
    mask_BL: torch.Tensor
    """1 over real tokens, 0 over left padding, for every cached column."""
    next_B: torch.Tensor
    """The last sampled token of each row, not yet in the cache."""
    pos_B: torch.Tensor
    """Position id of next_B: the number of real tokens before it."""
    joinable: bool
    """Plain full-attention cache: rows may be merged in and padding trimmed."""


def check_request(
    prompt_ids: list[int], params: SamplingParams, max_context: int, vocab_size: int
) -> None:
    """Refuse, with a ValueError the caller sees at once, what the worker cannot decode."""
    if not prompt_ids:
        raise ValueError("prompt is empty")
    if len(prompt_ids) >= max_context:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens; max_context is {max_context}, "
            "which leaves no room for a completion"
        )
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(f"prompt has token ids outside [0, {vocab_size})")
    if params.max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    if params.temperature < 0:
        raise ValueError("temperature must be >= 0")
    if not 0 < params.top_p <= 1:
        raise ValueError("top_p must be in (0, 1]")


def new_row(request: Request, generator: torch.Generator, version: int, max_context: int) -> Row:
    """A row for `request`, decoded by weights `version` and sampled by `generator`."""
    params = request.params
    stops = [s for s in params.stop if s]
    return Row(
        request=request,
        generator=generator,
        budget=min(params.max_tokens, max_context - len(request.prompt_ids)),
        version=version,
        stops=stops,
        # Every token decodes to at least one byte, so this many tokens cover any stop
        # string; +2 absorbs a leading space some decoders drop.
        stop_window=max((len(s.encode()) for s in stops), default=0) + 2,
    )


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_BL, mask_BL): the prompts right-aligned, padding on the left."""
    width = max(len(p) for p in prompts)
    ids_BL = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask_BL = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids_BL[i, width - len(prompt) :] = torch.tensor(prompt)
        mask_BL[i, width - len(prompt) :] = 1
    return ids_BL, mask_BL


def sample(batch: Batch, logits_BV: torch.Tensor) -> None:
    """Pick each row's next token with its own sampler; record it and its log-prob (and the
    most likely tokens, for a row that asks). A constrained row samples from, and records,
    its grammar-masked distribution."""
    rows = batch.rows
    logits_BV = masked([r.matcher for r in rows], logits_BV)
    params = [r.request.params for r in rows]
    temperature_B = torch.tensor(
        [effective_temperature(p.temperature) for p in params], device=logits_BV.device
    )
    logp_BV = logprobs_at_temperature(logits_BV, temperature_B)
    token_B = logits_BV.float().argmax(-1)
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    if sampled:
        # top_p of 1 becomes 2 so rounding in the cumulative sum never drops a token.
        top_p_S = torch.tensor(
            [params[i].top_p if params[i].top_p < 1 else 2.0 for i in sampled],
            device=logits_BV.device,
        )
        probs_SV = _top_p_filter(logp_BV[sampled].exp(), top_p_S)
        draws = [
            torch.multinomial(probs_SV[j], 1, generator=rows[i].generator)
            for j, i in enumerate(sampled)
        ]
        token_B[sampled] = torch.cat(draws)
    logp_B = logp_BV.gather(1, token_B[:, None])[:, 0]
    _record_top(rows, logp_BV)
    batch.next_B = token_B
    for row, token, logp in zip(rows, token_B.tolist(), logp_B.tolist(), strict=True):
        row.completion_ids.append(token)
        row.logprobs.append(logp)
        if row.matcher is not None:
            row.matcher.advance(token)


def _record_top(rows: list[Row], logp_BV: torch.Tensor) -> None:
    """Append each asking row's most likely tokens at this step (tokens its grammar masks
    out, at -inf, are no alternatives)."""
    asking = [i for i, r in enumerate(rows) if r.request.params.top_logprobs > 0]
    if not asking:
        return
    k = min(max(rows[i].request.params.top_logprobs for i in asking), logp_BV.shape[-1])
    values_AK, ids_AK = logp_BV[asking].float().topk(k, dim=-1)
    for values, ids, i in zip(values_AK.tolist(), ids_AK.tolist(), asking, strict=True):
        wanted = rows[i].request.params.top_logprobs
        top = [(t, v) for t, v in zip(ids[:wanted], values[:wanted], strict=True) if v > -math.inf]
        rows[i].top_logprobs.append(top)


def select(batch: Batch, keep: list[int]) -> Batch:
    """Keep only the rows `keep`; drop cache columns no remaining row uses."""
    index_K = torch.tensor(keep, device=batch.mask_BL.device)
    batch.cache.batch_select_indices(index_K)
    batch.rows = [batch.rows[i] for i in keep]
    batch.mask_BL = batch.mask_BL[index_K]
    batch.next_B = batch.next_B[index_K]
    batch.pos_B = batch.pos_B[index_K]
    if batch.joinable:
        _trim_left(batch)
    return batch


def merge(a: Batch, b: Batch) -> Batch:
    """One batch holding a's rows then b's, both left-padded to the longer cache."""
    width = max(a.mask_BL.shape[1], b.mask_BL.shape[1])

    def pad_left(x: torch.Tensor, dim_from_end: int) -> torch.Tensor:
        missing = width - x.shape[-dim_from_end]
        return F.pad(x, (0, 0) * (dim_from_end - 1) + (missing, 0))

    for la, lb in zip(_dynamic_layers(a.cache), _dynamic_layers(b.cache), strict=True):
        (keys_a, values_a), (keys_b, values_b) = _kv(la), _kv(lb)
        la.keys = torch.cat([pad_left(keys_a, 2), pad_left(keys_b, 2)])
        la.values = torch.cat([pad_left(values_a, 2), pad_left(values_b, 2)])
    a.mask_BL = torch.cat([pad_left(a.mask_BL, 1), pad_left(b.mask_BL, 1)])
    a.next_B = torch.cat([a.next_B, b.next_B])
    a.pos_B = torch.cat([a.pos_B, b.pos_B])
    a.rows = a.rows + b.rows
    return a


def joinable(cache: DynamicCache) -> bool:
    """True for a plain full-attention cache, the only kind batch surgery knows how to edit.

    Sliding-window, linear-attention or KV-sharing layers make a batch run to completion
    before the next one is admitted (dynamic batching).
    """
    return all(
        type(layer) is DynamicLayer and getattr(layer, "keys", None) is not None
        for layer in cache.layers
    )


def deliver(request: Request, outcome: Generation | BaseException) -> None:
    """Hand a result or an error to the caller's event loop (from the worker thread)."""
    # A closed loop raises RuntimeError: its caller is gone and nobody is waiting any more.
    with contextlib.suppress(RuntimeError):
        request.loop.call_soon_threadsafe(_settle, request.future, outcome)


def notify(rows: list[Row]) -> None:
    """Send each streaming row's newest token to its caller (from the worker thread, after
    a step): one wake-up per event loop, however many rows stream to it."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, int]]] = {}
    for row in rows:
        if row.request.tokens is not None:
            item = (row.request.tokens, row.completion_ids[-1])
            by_loop.setdefault(row.request.loop, []).append(item)
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, int]]) -> None:
    for tokens, token in items:
        tokens.put_nowait(token)


async def relay(request: Request) -> AsyncIterator[list[int] | Generation]:
    """A streaming request's tokens as `notify` delivers them, then its Generation (or its
    error). Stopping early cancels the request, so the worker drops its row."""
    tokens, future = request.tokens, request.future
    assert tokens is not None, "relay needs a request built with a token queue"
    # Tokens are queued by callbacks scheduled before the one settling the future, so the
    # future lands in the queue after the last token.
    future.add_done_callback(tokens.put_nowait)
    try:
        while True:
            items = [await tokens.get()]
            while not tokens.empty():
                items.append(tokens.get_nowait())
            ids = [i for i in items if isinstance(i, int)]
            if ids:
                yield ids
            if len(ids) < len(items):
                yield future.result()
                return
    finally:
        future.cancel()


def _settle(future: asyncio.Future[Generation], outcome: Generation | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _trim_left(batch: Batch) -> None:
    """Cut leading columns that are padding in every row (left by a longer row that left)."""
    start = int(batch.mask_BL.any(0).int().argmax())
    if start == 0:
        return
    for layer in _dynamic_layers(batch.cache):
        keys, values = _kv(layer)
        layer.keys, layer.values = keys[:, :, start:], values[:, :, start:]
    batch.mask_BL = batch.mask_BL[:, start:]


def _dynamic_layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's layers, which only joinable batches touch: all plain DynamicLayers."""
    return cast(list[DynamicLayer], cache.layers)


def _kv(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """A filled layer's keys and values, each [B, heads, L, head_dim]."""
    assert layer.keys is not None and layer.values is not None, "prefill fills every layer"
    return layer.keys, layer.values


def _top_p_filter(probs_BV: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """Zero every token outside each row's nucleus (the smallest set holding top_p mass)."""
    sorted_BV, order_BV = probs_BV.sort(-1, descending=True)
    mass_before_BV = sorted_BV.cumsum(-1) - sorted_BV
    sorted_BV = sorted_BV.masked_fill(mass_before_BV >= top_p_B[:, None], 0.0)
    return torch.zeros_like(probs_BV).scatter(-1, order_BV, sorted_BV)


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """End tokens from the generation config, the model config and the tokenizer, in order."""
    generation_config = getattr(model, "generation_config", None)
    candidates = [
        getattr(generation_config, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        tokenizer.eos_token_id,
    ]
    ids: list[int] = []
    for candidate in candidates:
        for token in candidate if isinstance(candidate, list) else [candidate]:
            if token is not None and token not in ids:
                ids.append(int(token))
    if not ids:
        raise ValueError("the model declares no end token (eos_token_id)")
    return ids
