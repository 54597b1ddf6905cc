"""tracerl's extension of vLLM's workers; it runs inside the vLLM servers, not in tracerl.

Loaded by each vLLM worker (`--worker-extension-cls
tracerl.engines.vllm_worker.TracerlWorkerExtension`, with tracerl's source on PYTHONPATH), so
it imports only what the vLLM environment has: torch and vllm, lazily. It fixes two things
tracerl's contract needs (checked by tests/test_engine_vllm.py):

- Weight reload with a tied output head. The CPU backend keeps a packed copy of each
  embedding-shaped weight for its GEMM kernels; `reload_weights` refreshes the embedding in
  place but never the packed copy of a tied head, which keeps computing logits from the old
  weights. `tracerl_reload_weights` reloads, then repacks those layers from their weights.
- Log-probs before top-p. `--logprobs-mode processed_logprobs` reports log-probs after the
  temperature *and* after top-k/top-p renormalisation; tracerl records log_softmax(logits/T)
  before any truncation (tracerl.engines.scoring), which a trainer can recompute. The
  sampler is wrapped at import time, before any worker builds one, to take them there.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from tracerl.engines.owner import watch_owner

__all__ = ["TracerlWorkerExtension"]


class TracerlWorkerExtension:
    """Mixed into vLLM's worker class: its methods are callable by /collective_rpc."""

    def tracerl_reload_weights(self, weights_path: str) -> None:
        """Load the checkpoint-format weights in the directory `weights_path` in place."""
        worker: Any = self
        worker.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        _repack_embedding_gemms(worker.model_runner.get_model())


def _repack_embedding_gemms(model: Any) -> None:
    """Rebuild the CPU GEMM of every embedding-shaped layer (a tied head is one)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
    )

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            # A no-op on GPUs; on the CPU it packs the current weight again.
            method.process_weights_after_loading(module)


def _logprobs_before_truncation(forward: Any) -> Any:
    """Wrap a TopKTopPSampler forward to report log_softmax of the logits it is given
    (temperature applied, top-k/top-p not yet) in processed_logprobs mode."""

    @functools.wraps(forward)
    def wrapped(self: Any, logits: Any, generators: Any, k: Any, p: Any) -> Any:
        if self.logprobs_mode != "processed_logprobs" or (k is None and p is None):
            return forward(self, logits, generators, k, p)
        # Taken before the call: the sampler edits the logits in place.
        before = logits.log_softmax(dim=-1, dtype=_float32())
        sampled, _ = forward(self, logits, generators, k, p)
        return sampled, before

    return wrapped


def _float32() -> Any:
    import torch

    return torch.float32


def _patch_sampler() -> None:
    """Swap the sampler's forwards for wrapped ones, once per process."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    if getattr(TopKTopPSampler, "_tracerl_patched", False):
        return
    for name in ("forward_native", "forward_cpu"):
        if hasattr(TopKTopPSampler, name):
            setattr(
                TopKTopPSampler, name, _logprobs_before_truncation(getattr(TopKTopPSampler, name))
            )
    TopKTopPSampler._tracerl_patched = True  # type: ignore[attr-defined]


# Imported outside a vLLM environment (docs, linters) there is nothing to patch.
with contextlib.suppress(ImportError):
    _patch_sampler()

# In a server tracerl started: stop when the process that started it is gone (owner.py).
watch_owner()
