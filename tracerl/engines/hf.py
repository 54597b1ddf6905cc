"""The transformers engine: batched sampling with a KV cache, on CPU or GPU.

A background thread owns the model. `generate`, called on the gateway's event loop, puts a
request on a queue and awaits a future. The thread runs one decode loop over every request
in flight (continuous batching): requests that arrive while others decode are prefilled
together and joined to the running batch between two decode steps, and a row leaves the
batch as soon as it finishes. Rows are left-padded; position ids count real tokens only,
so a padded row computes exactly what it would alone.

New weights (`load_weights`, `load_state_dict`) are staged, admission pauses, the running
batch drains on the old weights, then the thread switches models. Every completion is
therefore sampled by one version, which its Generation records.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.cache_utils import DynamicLayer

from tracerl.engines.scoring import effective_temperature, logprobs_at_temperature
from tracerl.types import Generation, SamplingParams

__all__ = ["EngineStats", "HFEngine"]


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
class _Request:
    """One `generate` call waiting for the worker."""

    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[Generation]
    loop: asyncio.AbstractEventLoop


@dataclass
class _Row:
    """A request being decoded: its sampler and what it has produced so far."""

    request: _Request
    generator: torch.Generator
    budget: int
    """Most tokens it may sample: max_tokens, capped by max_context."""
    version: int
    """Version of the weights decoding it."""
    stops: list[str]
    stop_window: int
    """How many trailing tokens to decode to see any stop string whole."""
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class _Batch:
    """The running rows and their shared KV cache (B rows, L cached columns)."""

    rows: list[_Row]
    cache: DynamicCache
    mask_BL: torch.Tensor
    """1 over real tokens, 0 over left padding, for every cached column."""
    next_B: torch.Tensor
    """The last sampled token of each row, not yet in the cache."""
    pos_B: torch.Tensor
    """Position id of next_B: the number of real tokens before it."""
    joinable: bool
    """Plain full-attention cache: rows may be merged in and padding trimmed."""


class HFEngine:
    """A transformers causal LM served with continuous batching (see the module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 32,
        max_context: int | None = None,
        policy_version: int = 0,
        seed: int = 0,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)
        self._model = self._load_model(model_dir)
        config = self._model.config
        self.max_context: int = max_context or config.max_position_embeddings
        self.eos_token_ids: list[int] = _eos_token_ids(self._model, self.tokenizer)
        self.policy_version = policy_version
        self._serving_version = policy_version
        self._vocab_size = cast(
            torch.nn.Embedding, self._model.get_input_embeddings()
        ).num_embeddings
        pad_id = self.tokenizer.pad_token_id
        self._pad_id = pad_id if pad_id is not None else self.eos_token_ids[0]
        self._eos = frozenset(self.eos_token_ids)
        # The worker decodes stop-string tails with its own copy: a fast tokenizer used from
        # two threads at once can fail with "Already borrowed".
        self._stop_decoder = copy.deepcopy(self.tokenizer)
        self._rng = torch.Generator().manual_seed(seed)
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._waiting: list[_Request] = []
        self._batch: _Batch | None = None
        self._pending: tuple[PreTrainedModel, int] | None = None
        self._lock = threading.Lock()
        self._counters = EngineStats()  # written by the worker only
        self._outbox: list[tuple[_Request, Generation | BaseException]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._thread.start()

    # -- public API, called from the event loop or a trainer -------------------------------

    @property
    def model(self) -> PreTrainedModel:
        """The model decoding now (read-only use: scoring, inspection)."""
        return self._model

    @property
    def stats(self) -> EngineStats:
        """A snapshot of what the engine has done so far."""
        return self._counters.model_copy()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Sample one completion; concurrent calls share forward passes."""
        self._check(prompt_ids, params)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Generation] = loop.create_future()
        self._queue.put(_Request(list(prompt_ids), params, future, loop))
        return await future

    def load_weights(self, path: str | Path, version: int) -> None:
        """Serve the HF model dir `path` as `version` once the running batch has drained.

        Blocks while it reads the weights; a busy server may run it in a thread
        (`await asyncio.to_thread(engine.load_weights, path, version)`).
        """
        self._stage(self._load_model(path), version)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Serve `state_dict` (same keys as the model's) as `version`, without touching disk.

        The tensors are copied now, so the caller may keep training them.
        """
        with self._lock:
            base = self._pending[0] if self._pending is not None else self._model
        model = copy.deepcopy(base)
        model.load_state_dict(state_dict)
        self._stage(model, version)

    def close(self) -> None:
        """Stop the worker; requests still waiting or running fail with RuntimeError."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        # A request that slipped in while the worker was stopping must not wait forever.
        self._fail_in_flight(RuntimeError("engine closed"))
        self._send_outbox()

    # -- checks and loading ----------------------------------------------------------------

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if self._closed:
            raise RuntimeError("engine is closed")
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_context is {self.max_context}, "
                "which leaves no room for a completion"
            )
        if min(prompt_ids) < 0 or max(prompt_ids) >= self._vocab_size:
            raise ValueError(f"prompt has token ids outside [0, {self._vocab_size})")
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if params.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < params.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")

    def _load_model(self, path: str | Path) -> PreTrainedModel:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype, device_map=self.device)
        model.eval().requires_grad_(False)
        return model

    def _stage(self, model: PreTrainedModel, version: int) -> None:
        with self._lock:
            self._pending = (model, version)
        self.policy_version = version
        self._queue.put(None)  # wake an idle worker so it swaps now

    # -- the worker thread -----------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._closed:
                try:
                    self._collect(block=self._batch is None and not self._waiting)
                    self._swap_weights_if_drained()
                    self._admit()
                    self._step()
                except Exception as exc:  # a bug here must not kill the worker
                    self._fail_in_flight(exc)
                self._send_outbox()
            self._fail_in_flight(RuntimeError("engine closed"))
            self._send_outbox()

    def _collect(self, block: bool) -> None:
        try:
            item = self._queue.get() if block else self._queue.get_nowait()
            while True:
                if item is not None:
                    self._waiting.append(item)
                item = self._queue.get_nowait()
        except queue.Empty:
            pass

    def _swap_weights_if_drained(self) -> None:
        if self._batch is not None or self._pending is None:
            return
        with self._lock:
            (self._model, self._serving_version), self._pending = self._pending, None
        self._counters.weight_swaps += 1

    def _admit(self) -> None:
        """Prefill waiting requests and join them to the running batch."""
        running = self._batch
        if self._pending is not None or not self._waiting:
            return  # new weights wait for the running batch to drain
        if running is not None and not running.joinable:
            return
        free = self.max_batch_size - (len(running.rows) if running else 0)
        alive = [r for r in self._waiting if not r.future.done()]
        take, self._waiting = alive[:free], alive[free:]
        if not take:
            return
        rows = [self._new_row(r) for r in take]
        try:
            new = self._retire(self._prefill(rows))
        except Exception as exc:
            self._fail(rows, exc)
            return
        if new is not None:
            self._batch = new if running is None else _merge(running, new)
        self._note_rows()

    def _step(self) -> None:
        """One decode step for every running row."""
        batch = self._batch
        if batch is None:
            return
        try:
            batch.mask_BL = F.pad(batch.mask_BL, (0, 1), value=1)
            out = self._model(
                input_ids=batch.next_B[:, None],
                attention_mask=batch.mask_BL,
                position_ids=batch.pos_B[:, None],
                cache=batch.cache,
                use_cache=True,
            )
            batch.pos_B = batch.pos_B + 1
            self._sample(batch, out.logits[:, -1])
        except Exception as exc:
            self._batch = None
            self._fail(batch.rows, exc)
            return
        self._counters.decode_steps += 1
        self._batch = self._retire(batch)
        self._note_rows()

    def _new_row(self, request: _Request) -> _Row:
        params = request.params
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        stops = [s for s in params.stop if s]
        return _Row(
            request=request,
            generator=torch.Generator(device=self.device).manual_seed(seed),
            budget=min(params.max_tokens, self.max_context - len(request.prompt_ids)),
            version=self._serving_version,
            stops=stops,
            # Every token decodes to at least one byte, so this many tokens cover any stop
            # string; +2 absorbs a leading space some decoders drop.
            stop_window=max((len(s.encode()) for s in stops), default=0) + 2,
        )

    def _prefill(self, rows: list[_Row]) -> _Batch:
        """Run the left-padded prompts through the model and sample each row's first token."""
        prompts = [r.request.prompt_ids for r in rows]
        width = max(len(p) for p in prompts)
        ids_BL = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        mask_BL = torch.zeros((len(rows), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids_BL[i, width - len(prompt) :] = torch.tensor(prompt)
            mask_BL[i, width - len(prompt) :] = 1
        ids_BL, mask_BL = ids_BL.to(self.device), mask_BL.to(self.device)
        # Positions count real tokens, so left padding does not shift them.
        pos_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self._model.config)
        out = self._model(
            input_ids=ids_BL,
            attention_mask=mask_BL,
            position_ids=pos_BL,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        batch = _Batch(
            rows=rows,
            cache=cache,
            mask_BL=mask_BL,
            next_B=ids_BL[:, -1],  # replaced by the first sampled tokens just below
            pos_B=mask_BL.sum(-1),
            joinable=_joinable(cache),
        )
        self._counters.batches += 1
        self._sample(batch, out.logits[:, -1])
        return batch

    def _sample(self, batch: _Batch, logits_BV: torch.Tensor) -> None:
        """Pick each row's next token with its own sampler; record its log-prob."""
        rows = batch.rows
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
        batch.next_B = token_B
        for row, token, logp in zip(rows, token_B.tolist(), logp_B.tolist(), strict=True):
            row.completion_ids.append(token)
            row.logprobs.append(logp)
        self._counters.tokens += len(rows)

    def _retire(self, batch: _Batch) -> _Batch | None:
        """Answer finished rows, forget cancelled ones, and drop both from the batch."""
        keep = []
        for i, row in enumerate(batch.rows):
            if row.request.future.cancelled():
                continue
            finish = self._finish(row)
            if finish is None:
                keep.append(i)
            else:
                self._answer(row, *finish)
        if len(keep) == len(batch.rows):
            return batch
        if not keep:
            return None
        return _select(batch, keep)

    def _finish(self, row: _Row) -> tuple[str, str | None] | None:
        """(finish_reason, stop_string) if the row is done, else None."""
        if row.completion_ids[-1] in self._eos:
            return "stop", None
        if row.stops:
            tail = row.completion_ids[-row.stop_window :]
            text = self._stop_decoder.decode(tail, skip_special_tokens=False)
            # Checked after every token, so a match in the tail was completed by the last one.
            for stop in row.stops:
                if stop in text:
                    return "stop", stop
        if len(row.completion_ids) >= row.budget:
            return "length", None
        return None

    def _answer(self, row: _Row, finish_reason: str, stop_string: str | None) -> None:
        generation = Generation(
            completion_ids=row.completion_ids,
            logprobs=row.logprobs,
            finish_reason=finish_reason,
            policy_version=row.version,
            stop_string=stop_string,
        )
        self._outbox.append((row.request, generation))

    def _fail(self, rows: list[_Row], exc: BaseException) -> None:
        self._outbox.extend((row.request, exc) for row in rows)

    def _fail_in_flight(self, exc: BaseException) -> None:
        """Fail the running batch and every waiting request; the worker goes on."""
        self._collect(block=False)
        waiting, self._waiting = self._waiting, []
        self._outbox.extend((request, exc) for request in waiting)
        batch, self._batch = self._batch, None
        if batch is not None:
            self._fail(batch.rows, exc)
        self._note_rows()

    def _send_outbox(self) -> None:
        """Deliver this iteration's answers, after the stats already count them."""
        outbox, self._outbox = self._outbox, []
        self._counters.requests += len(outbox)
        for request, outcome in outbox:
            _deliver(request, outcome)

    def _note_rows(self) -> None:
        running = len(self._batch.rows) if self._batch is not None else 0
        self._counters.running_rows = running
        self._counters.peak_rows = max(self._counters.peak_rows, running)


# -- batch surgery: select rows, merge batches, trim padding -------------------------------


def _select(batch: _Batch, keep: list[int]) -> _Batch:
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


def _trim_left(batch: _Batch) -> None:
    """Cut leading columns that are padding in every row (left by a longer row that left)."""
    start = int(batch.mask_BL.any(0).int().argmax())
    if start == 0:
        return
    for layer in _dynamic_layers(batch.cache):
        keys, values = _kv(layer)
        layer.keys, layer.values = keys[:, :, start:], values[:, :, start:]
    batch.mask_BL = batch.mask_BL[:, start:]


def _merge(a: _Batch, b: _Batch) -> _Batch:
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


def _joinable(cache: DynamicCache) -> bool:
    """True for a plain full-attention cache, the only kind batch surgery knows how to edit.

    Sliding-window, linear-attention or KV-sharing layers make a batch run to completion
    before the next one is admitted (dynamic batching).
    """
    return all(
        type(layer) is DynamicLayer and getattr(layer, "keys", None) is not None
        for layer in cache.layers
    )


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


def _deliver(request: _Request, outcome: Generation | BaseException) -> None:
    """Hand a result or an error to the caller's event loop."""
    # A closed loop raises RuntimeError: its caller is gone and nobody is waiting any more.
    with contextlib.suppress(RuntimeError):
        request.loop.call_soon_threadsafe(_settle, request.future, outcome)


def _settle(future: asyncio.Future[Generation], outcome: Generation | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
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
