"""A stand-in engine that answers instantly with fixed token ids.

Used to measure the gateway's own overhead and to test code above the engine without a
model: no thread hop, no model, one prebuilt answer returned as is.
"""

from __future__ import annotations

from collections.abc import Sequence

from tracerl.types import Generation, SamplingParams

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
    ) -> None:
        self.completion_ids = list(completion_ids)
        self.eos_token_ids = list(eos_token_ids)
        self.max_context = max_context
        self.policy_version = policy_version
        self.calls = 0
        """How many times generate was called."""
        self._answer = self._build(len(self.completion_ids))

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Return the fixed completion, cut to max_tokens ("length") if it is shorter."""
        self.calls += 1
        if len(prompt_ids) >= self.max_context:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_context is {self.max_context}"
            )
        if params.max_tokens >= len(self.completion_ids):
            return self._answer  # frozen, so one object serves every call
        return self._build(params.max_tokens)

    def load_weights(self, path: str, version: int) -> None:
        """Record the new version; there are no weights to load."""
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
