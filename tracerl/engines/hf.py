"""The transformers engine: batched sampling with a KV cache, on CPU or GPU.

A background thread owns the model. `generate`, called on the gateway's event loop, puts a
request on a queue and awaits a future. The thread runs one decode loop over every request
in flight (continuous batching): requests that arrive while others decode are prefilled
together and joined to the running batch between two decode steps, and a row leaves the
batch as soon as it finishes. Rows are left-padded; position ids count real tokens only,
so a padded row computes exactly what it would alone.

New weights (`load_state_dict`, the Engine protocol's weight sync, or `load_weights` from
a model dir) are staged, admission pauses, the running batch drains on the old weights,
then the thread switches models. Every completion is therefore sampled by one version,
which its Generation records. The batch itself, and its cache surgery, live in batch.py.
"""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from tracerl.engines.batch import (
    Batch,
    EngineStats,
    Request,
    Row,
    check_request,
    deliver,
    eos_token_ids,
    joinable,
    left_padded,
    merge,
    new_row,
    notify,
    relay,
    sample,
    select,
)
from tracerl.engines.constrained import Grammars, check_grammar
from tracerl.types import Generation, SamplingParams

if TYPE_CHECKING:
    from tracerl.engines.base import Engine, StreamingEngine

__all__ = ["EngineStats", "HFEngine"]


class HFEngine:
    """A transformers causal LM served with continuous batching (see the module docstring)."""

    constrains_decoding = True
    """It enforces a ConstrainedParams grammar (and records the masked log-probs)."""

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
        self.eos_token_ids: list[int] = eos_token_ids(self._model, self.tokenizer)
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
        self._grammars = Grammars(self._stop_decoder, self.eos_token_ids, self._vocab_size)
        self._rng = torch.Generator().manual_seed(seed)
        self._queue: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._waiting: list[Request] = []
        self._batch: Batch | None = None
        self._pending: tuple[PreTrainedModel, int] | None = None
        self._lock = threading.Lock()
        self._counters = EngineStats()  # written by the worker only
        self._outbox: list[tuple[Request, Generation | BaseException]] = []
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

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, routing_key: str | None = None
    ) -> Generation:
        """Sample one completion; concurrent calls share forward passes (one replica: the
        routing key is ignored)."""
        return await self._submit(prompt_ids, params, streaming=False).future

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[list[int] | Generation]:
        """Like generate, yielding token ids as each decode step samples them, then the
        Generation (the StreamingEngine protocol)."""
        async for item in relay(self._submit(prompt_ids, params, streaming=True)):
            yield item

    def load_weights(self, path: str | Path, version: int) -> None:
        """Serve the HF model dir `path` as `version` once the running batch has drained.

        Not part of the Engine protocol (weights move by `load_state_dict`); kept for
        serving a saved checkpoint. Blocks while it reads the weights.
        """
        self._stage(self._load_model(path), version)

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Serve `state` (same keys as the model's) as `version`, without touching disk.

        The tensors are copied now, so the caller may keep training them; the worker
        switches to the copy between decode steps, once the running batch has drained.
        """
        with self._lock:
            base = self._pending[0] if self._pending is not None else self._model
        model = copy.deepcopy(base)
        model.load_state_dict(state)
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

    def _submit(self, prompt_ids: list[int], params: SamplingParams, streaming: bool) -> Request:
        """Check a request and queue it for the worker (on the caller's event loop)."""
        if self._closed:
            raise RuntimeError("engine is closed")
        check_request(prompt_ids, params, self.max_context, self._vocab_size)
        check_grammar(params)
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue | None = asyncio.Queue() if streaming else None
        request = Request(list(prompt_ids), params, loop.create_future(), loop, tokens)
        self._queue.put(request)
        return request

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
            self._batch = new if running is None else merge(running, new)
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

    def _new_row(self, request: Request) -> Row:
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        generator = torch.Generator(device=self.device).manual_seed(seed)
        row = new_row(request, generator, self._serving_version, self.max_context)
        row.matcher = self._grammars.matcher(request.params)
        return row

    def _prefill(self, rows: list[Row]) -> Batch:
        """Run the left-padded prompts through the model and sample each row's first token."""
        ids_BL, mask_BL = left_padded([r.request.prompt_ids for r in rows], self._pad_id)
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
        batch = Batch(
            rows=rows,
            cache=cache,
            mask_BL=mask_BL,
            next_B=ids_BL[:, -1],  # replaced by the first sampled tokens just below
            pos_B=mask_BL.sum(-1),
            joinable=joinable(cache),
        )
        self._counters.batches += 1
        self._sample(batch, out.logits[:, -1])
        return batch

    def _sample(self, batch: Batch, logits_BV: torch.Tensor) -> None:
        sample(batch, logits_BV)
        notify(batch.rows)
        self._counters.tokens += len(batch.rows)

    def _retire(self, batch: Batch) -> Batch | None:
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
        return select(batch, keep)

    def _finish(self, row: Row) -> tuple[str, str | None] | None:
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

    def _answer(self, row: Row, finish_reason: str, stop_string: str | None) -> None:
        generation = Generation(
            completion_ids=row.completion_ids,
            logprobs=row.logprobs,
            finish_reason=finish_reason,
            policy_version=row.version,
            stop_string=stop_string,
            top_logprobs=row.top_logprobs,
        )
        self._outbox.append((row.request, generation))

    def _fail(self, rows: list[Row], exc: BaseException) -> None:
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
            deliver(request, outcome)

    def _note_rows(self) -> None:
        running = len(self._batch.rows) if self._batch is not None else 0
        self._counters.running_rows = running
        self._counters.peak_rows = max(self._counters.peak_rows, running)


if TYPE_CHECKING:  # mypy checks every member against the Engine protocols
    _: Engine = HFEngine("")
    _s: StreamingEngine = HFEngine("")
