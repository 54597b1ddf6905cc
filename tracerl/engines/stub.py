"""A stand-in engine that answers instantly with fixed token ids.

Used to measure the gateway's own overhead and to test code above the engine without a
model: no thread hop, no model, one prebuilt answer returned as is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from tracerl.types import Generation, SamplingParams

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedTokenizerBase

    from tracerl.engines.base import Engine, StreamingEngine

__all__ = ["StubEngine"]


class StubEngine:
    """Answers every prompt with `completion_ids` (log-prob -0.5 each, finish "stop")."""

    def __init__(
        self,
        completion_ids: Sequence[int] = (1, 2, 3),
        *,
        eos_token_ids: Sequence[int] = (0,),
        max_context: int = 4096,
        policy_version: int = 0,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        self.completion_ids = list(completion_ids)
        self.eos_token_ids = list(eos_token_ids)
        self.max_context = max_context
        self.policy_version = policy_version
        self.calls = 0
        """How many times generate was called."""
        self._tokenizer = tokenizer
        self._answer = self._build(len(self.completion_ids))

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer given at construction; a stub built without one has none."""
        if self._tokenizer is None:
            # AttributeError, so isinstance(stub, Engine) is honestly False without one.
            raise AttributeError("this StubEngine was built without a tokenizer")
        return self._tokenizer

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, routing_key: str | None = None
    ) -> Generation:
        """Return the fixed completion, cut to max_tokens ("length") if it is shorter."""
        self.calls += 1
        if len(prompt_ids) >= self.max_context:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_context is {self.max_context}"
            )
        if params.max_tokens >= len(self.completion_ids):
            return self._answer  # frozen, so one object serves every call
        return self._build(params.max_tokens)

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[list[int] | Generation]:
        """The fixed completion one token at a time, then its Generation."""
        gen = await self.generate(prompt_ids, params)
        for token in gen.completion_ids:
            yield [token]
        yield gen

    def load_state_dict(self, state: dict[str, Tensor], version: int) -> None:
        """Record the new version; the stub has no weights to replace."""
        self.policy_version = version
        self._answer = self._build(len(self.completion_ids))

    def close(self) -> None:
        """Nothing to stop."""

    def _build(self, n: int) -> Generation:
        return Generation(
            completion_ids=self.completion_ids[:n],
            logprobs=[-0.5] * n,
            finish_reason="stop" if n == len(self.completion_ids) else "length",
            policy_version=self.policy_version,
        )


if TYPE_CHECKING:  # mypy checks every member against the Engine protocol
    _: Engine = StubEngine()
    _s: StreamingEngine = StubEngine()
