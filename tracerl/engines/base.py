"""The engine interface: generate from token ids, load a new policy version.

Small on purpose, so that a transformers engine (CPU or GPU) and a vLLM engine both fit
behind it. The gateway owns tokenization and chat templates; an engine sees only ids. (A
role served by a remote OpenAI-compatible server speaks text, not ids, so it is no engine:
the gateway forwards it, see tracerl.gateway.remote.)
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tracerl.types import Generation, SamplingParams


@runtime_checkable
class Engine(Protocol):
    """A served policy. Every method is safe to call from the gateway's event loop."""

    policy_version: int
    """Version of the weights that new requests are sampled from."""
    max_context: int
    """Longest prompt + completion the engine accepts, in tokens."""
    eos_token_ids: list[int]
    """Token ids that end a completion."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Sample one completion; concurrent calls are batched by the engine."""
        ...

    def load_weights(self, path: str, version: int) -> None:
        """Serve the weights in `path` (an HF model dir) as `version`.

        Requests already being generated finish on the old weights and record the old
        version; the switch happens between generation batches.
        """
        ...

    def close(self) -> None:
        """Stop background work and free memory."""
        ...
