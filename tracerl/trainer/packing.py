"""Packing training rows into padded micro-batches that fit a token budget.

Rows are sorted longest first and filled greedily (first-fit decreasing: because rows only
get shorter, a batch that cannot take the next row can take no later one), so each
micro-batch's padded size B x T_max stays within `max_tokens`; a row longer than the
budget gets a batch of its own. Rows are right-padded; padding has attention 0, mask 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from tracerl.types import Transition

__all__ = ["MicroBatch", "pack"]


class MicroBatch(NamedTuple):
    """A padded batch of rows, ready for the model and `policy_loss`. All [B, T] unless
    noted; padding positions hold 0."""

    input_ids_BT: Tensor
    """Token ids (int64)."""
    attention_mask_BT: Tensor
    """1 on real tokens, 0 on padding (int64)."""
    loss_mask_BT: Tensor
    """1 on sampled tokens (float32)."""
    behaviour_logp_BT: Tensor
    """Behaviour log-prob of each sampled token (float32)."""
    adv_BT: Tensor
    """Advantage of each sampled token (float32)."""
    weight_BT: Tensor
    """Loss weight of each sampled token: the row's `weight` (float32)."""
    temperature_B: Tensor
    """[B] sampling temperature of each row, for `token_logprobs` (float32)."""
    row_indices: list[int]
    """Index in the packed list of each batch row, in batch order."""


def pack(rows: list[Transition], max_tokens: int) -> list[MicroBatch]:
    """Pack rows into micro-batches of padded size B x T_max <= max_tokens."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].input_ids), reverse=True)
    groups: list[list[int]] = []
    for i in order:
        # The open batch's first row is its longest, so it fixes T_max.
        if groups and (len(groups[-1]) + 1) * len(rows[groups[-1][0]].input_ids) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [_collate(rows, g) for g in groups]


def _collate(rows: list[Transition], idx: list[int]) -> MicroBatch:
    picked = [rows[i] for i in idx]
    T = max(len(r.input_ids) for r in picked)

    def pad(values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor([v + [0] * (T - len(v)) for v in values], dtype=dtype)

    mask = [r.loss_mask for r in picked]
    return MicroBatch(
        input_ids_BT=pad([r.input_ids for r in picked], torch.long),
        attention_mask_BT=pad([[1] * len(r.input_ids) for r in picked], torch.long),
        loss_mask_BT=pad(mask, torch.float32),
        behaviour_logp_BT=pad([r.behaviour_logprobs for r in picked], torch.float32),
        adv_BT=pad([r.advantages for r in picked], torch.float32),
        weight_BT=pad([[r.weight * k for k in r.loss_mask] for r in picked], torch.float32),
        temperature_B=torch.tensor([r.temperature for r in picked], dtype=torch.float32),
        row_indices=idx,
    )
