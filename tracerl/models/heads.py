"""Log-probs of target tokens without materialising the whole [B, T, V] logits.

A pretrained model's vocabulary makes full logits large: 16 rows x 512 tokens x 49,152 x 4
bytes is 1.6 GB for SmolLM2, and as much again for their gradient. Training and scoring need
the log-prob of one token per position, and SFT only at the positions its loss falls on. So
the decoder runs once, the hidden states of the positions that matter are gathered, and the
output head and log-softmax run over them in chunks of `chunk` rows; under autograd each
chunk is checkpointed, so its logits are recomputed in the backward pass instead of kept.
Peak memory for the head is then one chunk's logits, whatever the batch.

Models whose head does more than a linear layer (a logit soft-cap or scale in the config)
take the plain path: full logits from the model's own forward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["TargetScores", "shared_prefix", "shared_prefix_logprobs", "target_logprobs"]

_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class TargetScores(NamedTuple):
    """Each scored target token, flattened in (row, position) order."""

    logp_N: Tensor
    """log_softmax(logits)[target] in fp32 (differentiable when grad is enabled)."""
    top_N: Tensor
    """Whether the target is the argmax (bool, detached)."""
    row_N: Tensor
    """The batch row each target belongs to."""


def _plain_head(model: torch.nn.Module) -> bool:
    """Whether the logits are exactly the output embedding of the last hidden state."""
    config = getattr(model, "config", None)
    return all(getattr(config, key, None) in (None, 1.0) for key in _HEAD_EXTRAS)


def _chunk_scores(head: torch.nn.Module, h_NH: Tensor, target_N: Tensor) -> tuple[Tensor, Tensor]:
    logits_NV = head(h_NH).float()
    logp_N = torch.log_softmax(logits_NV, dim=-1).gather(1, target_N[:, None])[:, 0]
    return logp_N, logits_NV.argmax(-1) == target_N


def target_logprobs(
    model: torch.nn.Module,
    ids_BT: Tensor,
    attn_BT: Tensor,
    labels_BT: Tensor,
    bf16: bool = False,
    chunk: int = 1024,
) -> TargetScores:
    """Scores of every position t whose label t+1 is not -100 (position t predicts token
    t+1, as the labels of a causal LM are shifted); bf16 autocast for the decoder and head
    when asked, log-probs in fp32."""
    target_BT = labels_BT[:, 1:]
    keep_BT = target_BT != -100
    row_N = torch.arange(ids_BT.shape[0], device=ids_BT.device)[:, None].expand_as(keep_BT)
    row_N = row_N[keep_BT]
    target_N = target_BT[keep_BT]
    with torch.autocast(ids_BT.device.type, dtype=torch.bfloat16, enabled=bf16):
        if not _plain_head(model):
            logits_BTV = model(input_ids=ids_BT, attention_mask=attn_BT).logits[:, :-1]
            logp_N, top_N = _chunk_scores(torch.nn.Identity(), logits_BTV[keep_BT], target_N)
            return TargetScores(logp_N, top_N.detach(), row_N)
        decoder = model.get_decoder()  # type: ignore[operator]
        hidden_BTH = decoder(input_ids=ids_BT, attention_mask=attn_BT).last_hidden_state
        h_NH = hidden_BTH[:, :-1][keep_BT]
        head = model.get_output_embeddings()  # type: ignore[operator]
        logps, tops = [], []
        for i in range(0, h_NH.shape[0], chunk):
            args = (head, h_NH[i : i + chunk], target_N[i : i + chunk])
            if torch.is_grad_enabled():
                logp, top = checkpoint(_chunk_scores, *args, use_reentrant=False)
            else:
                logp, top = _chunk_scores(*args)
            logps.append(logp)
            tops.append(top.detach())
    empty = h_NH.new_zeros(0, dtype=torch.float32)
    logp_N = torch.cat(logps) if logps else empty
    top_N = torch.cat(tops) if tops else torch.zeros(0, dtype=torch.bool, device=ids_BT.device)
    return TargetScores(logp_N, top_N, row_N)


def shared_prefix(ids_BT: Tensor, attn_BT: Tensor) -> int:
    """How many leading tokens every row of a right-padded batch has in common."""
    lengths_B = attn_BT.sum(dim=1)
    same_T = (ids_BT == ids_BT[:1]).all(dim=0)
    differs = torch.nonzero(~same_T)
    common = int(differs[0, 0]) if differs.numel() else ids_BT.shape[1]
    return min(common, int(lengths_B.min()))


def shared_prefix_logprobs(
    model: torch.nn.Module, ids_BT: Tensor, attn_BT: Tensor, labels_BT: Tensor, bf16: bool
) -> Tensor | None:
    """logp_N of the labelled targets (as `target_logprobs`), the prefix every row shares
    forwarded once (tracerl.trainer.prefix); None when the rows share under 2 tokens.

    Demonstrations of one agent share their system prompt and tool schemas, often most of
    their tokens (a tool block is ~150 tokens, a framework's prompt thousands): forwarding
    them once per batch instead of once per row is the same loss and gradients for a
    fraction of the compute (tests/test_sft_prefix.py checks both)."""
    from tracerl.trainer.loss import token_logprobs
    from tracerl.trainer.packing import MicroBatch
    from tracerl.trainer.prefix import TreeBatch, tree_logits

    common = shared_prefix(ids_BT, attn_BT)
    if common < 2 or ids_BT.shape[0] < 2:
        return None
    zeros_BT = torch.zeros_like(ids_BT, dtype=torch.float32)
    mb = MicroBatch(
        input_ids_BT=ids_BT, attention_mask_BT=attn_BT, loss_mask_BT=zeros_BT,
        behaviour_logp_BT=zeros_BT, adv_BT=zeros_BT, weight_BT=zeros_BT,
        temperature_B=torch.ones(ids_BT.shape[0]), row_indices=list(range(ids_BT.shape[0])),
    )  # fmt: skip
    logits = tree_logits(model, TreeBatch(mb, common - 1), bf16)
    logp_BT = logits.per_token(token_logprobs, ids_BT, mb.temperature_B.to(ids_BT.device))
    keep_BT = labels_BT != -100
    keep_BT[:, 0] = False  # the first token is never a target
    return logp_BT[keep_BT]
