"""A micro-batch's logits computed a chunk of positions at a time, never all at once.

A pretrained model's vocabulary makes a micro-batch's full logits large: 8,192 tokens x
49,152 (SmolLM2) x 4 bytes is 1.6 GB, and autograd keeps as much again. The trainer needs
one log-prob (and at most one entropy) per position, so `chunked_logits` runs the decoder
once and keeps its hidden states; `ChunkedLogits.per_token` then applies the output head and
`token_logprobs` (or `token_entropy`) to `chunk` positions at a time. Under autograd each
chunk is checkpointed: its logits are freed after the forward and recomputed in the backward
pass, so the head's peak memory is one chunk's logits whatever the micro-batch.

The values are those of `token_logprobs` on the whole logits: each chunk re-reads the
position before it, so every token's prediction comes from the same logits row.
Models whose head is more than a linear map (a soft-cap or logit scale), and FSDP2-sharded
models (tracerl.trainer.distributed), keep full logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from tracerl.trainer.packing import MicroBatch

__all__ = ["ChunkedLogits", "chunked_logits"]

PerToken = Callable[[Tensor, Tensor, Tensor], Tensor]
"""(logits_BCV, ids_BC, temp_B) -> values_BC, aligned like `token_logprobs`."""

_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class ChunkedLogits(NamedTuple):
    """The decoder's output, turned into logits only a chunk at a time."""

    hidden_BTH: Tensor
    """Last hidden states (position t predicts token t + 1)."""
    head: torch.nn.Module
    """The output head: hidden -> logits."""
    bf16: bool
    """Whether the head runs under bf16 autocast, like the decoder did."""
    chunk: int
    """Positions per chunk."""

    def per_token(self, fn: PerToken, ids_BT: Tensor, temp_B: Tensor) -> Tensor:
        """fn over every position as [B, T], equal to fn on the whole logits."""
        T = ids_BT.shape[1]
        parts = []
        for s in range(0, T, self.chunk):
            # From s - 1: fn's first output reads no logits; the chunk's first token reads
            # the position before it.
            lo, hi = max(0, s - 1), min(T, s + self.chunk)
            args = (self.hidden_BTH[:, lo:hi], ids_BT[:, lo:hi], temp_B)
            if torch.is_grad_enabled() and self.hidden_BTH.requires_grad:
                values = checkpoint(self._chunk, fn, *args, use_reentrant=False)
            else:
                values = self._chunk(fn, *args)
            parts.append(values if s == 0 else values[:, 1:])
        return torch.cat(parts, dim=1)

    def _chunk(self, fn: PerToken, h_BCH: Tensor, ids_BC: Tensor, temp_B: Tensor) -> Tensor:
        device = h_BCH.device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=self.bf16):
            logits_BCV = self.head(h_BCH)
        return fn(logits_BCV, ids_BC, temp_B)


def plain_head(model: torch.nn.Module) -> bool:
    """Whether the model's logits are its output embedding of the last hidden state, and its
    parts may be called on their own: an FSDP2-sharded root gathers its own parameters (the
    embeddings) only in its forward, so a sharded model keeps its full logits."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return False
    config = getattr(model, "config", None)
    has_parts = callable(getattr(model, "get_decoder", None)) and callable(
        getattr(model, "get_output_embeddings", None)
    )
    return has_parts and all(getattr(config, k, None) in (None, 1.0) for k in _HEAD_EXTRAS)


def chunked_logits(
    model: torch.nn.Module, mb: MicroBatch, bf16: bool, chunk: int = 512
) -> ChunkedLogits | Tensor:
    """The micro-batch's logits, chunked (`ChunkedLogits`), or the full logits_BTV of a
    model whose head is not a plain linear map."""
    device = next(model.parameters()).device
    ids_BT, attn_BT = mb.input_ids_BT.to(device), mb.attention_mask_BT.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        if not plain_head(model):
            return model(input_ids=ids_BT, attention_mask=attn_BT).logits
        decoder = model.get_decoder()  # type: ignore[operator]
        hidden_BTH = decoder(input_ids=ids_BT, attention_mask=attn_BT).last_hidden_state
    head = model.get_output_embeddings()  # type: ignore[operator]
    return ChunkedLogits(hidden_BTH, head, bf16, chunk)
