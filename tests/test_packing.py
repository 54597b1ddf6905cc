"""Packing rows into padded micro-batches under a token budget."""

from __future__ import annotations

import random

import pytest
import torch

from tracerl.trainer.config import LossConfig
from tracerl.trainer.loss import loss_weights, policy_loss
from tracerl.trainer.packing import pack
from tracerl.types import Transition


def make_rows(lengths: list[int], seed: int = 0) -> list[Transition]:
    rng = random.Random(seed)
    rows = []
    for i, n in enumerate(lengths):
        mask = [0] + [rng.randrange(2) for _ in range(n - 1)]
        rows.append(
            Transition(
                rollout_id=f"r{i}",
                group_id="g",
                task_id="t",
                role="policy",
                input_ids=[rng.randrange(1, 100) for _ in range(n)],
                loss_mask=mask,
                behaviour_logprobs=[-rng.random() * m for m in mask],
                versions=[0 if m else -1 for m in mask],
                advantages=[rng.uniform(-1, 1) * m for m in mask],
                reward=0.0,
                span_ids=[f"s{i}"],
                num_spans=1,
                weight=rng.uniform(0.5, 2.0),
                temperature=0.5 + i,
            )
        )
    return rows


def test_budget_is_respected_and_every_row_lands_once() -> None:
    rows = make_rows([5, 17, 3, 9, 40, 8, 8, 12, 2])
    batches = pack(rows, max_tokens=32)
    seen = sorted(i for mb in batches for i in mb.row_indices)
    assert seen == list(range(len(rows)))
    for mb in batches:
        B, T = mb.input_ids_BT.shape
        assert B * T <= 32 or B == 1
        assert max(len(rows[i].input_ids) for i in mb.row_indices) == T
    (big,) = [mb for mb in batches if 4 in mb.row_indices]
    assert big.row_indices == [4]  # longer than the budget: alone


def test_tensors_hold_the_rows_right_padded() -> None:
    rows = make_rows([6, 3, 4])
    (mb,) = pack(rows, max_tokens=100)
    for b, i in enumerate(mb.row_indices):
        r, n = rows[i], len(rows[i].input_ids)
        pad = mb.input_ids_BT.shape[1] - n
        assert mb.input_ids_BT[b].tolist() == r.input_ids + [0] * pad
        assert mb.attention_mask_BT[b].tolist() == [1] * n + [0] * pad
        assert mb.loss_mask_BT[b].tolist() == r.loss_mask + [0] * pad
        assert mb.behaviour_logp_BT[b].tolist() == pytest.approx(r.behaviour_logprobs + [0.0] * pad)
        assert mb.adv_BT[b].tolist() == pytest.approx(r.advantages + [0.0] * pad)
        assert mb.weight_BT[b].tolist() == pytest.approx(
            [r.weight * m for m in r.loss_mask] + [0.0] * pad
        )
        assert mb.temperature_B[b].item() == pytest.approx(r.temperature)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batches_with_global_denominator_sum_to_the_full_batch_loss(aggregation) -> None:
    rows = make_rows([5, 17, 3, 9, 11, 8, 8, 12, 2], seed=1)
    rng = random.Random(2)
    # One current log-prob per token, the same whichever batch the row lands in.
    cur = [[-rng.random() for _ in r.input_ids] for r in rows]
    cfg = LossConfig(aggregation=aggregation)

    def losses(max_tokens: int) -> float:
        batches = pack(rows, max_tokens)
        denom = sum(
            loss_weights(mb.loss_mask_BT, mb.weight_BT, aggregation).sum() for mb in batches
        )
        total = 0.0
        for mb in batches:
            T = mb.input_ids_BT.shape[1]
            logp = torch.tensor([cur[i] + [0.0] * (T - len(cur[i])) for i in mb.row_indices])
            prox = logp + 0.1 * mb.loss_mask_BT
            loss, _ = policy_loss(
                logp,
                prox,
                mb.behaviour_logp_BT,
                mb.adv_BT,
                mb.loss_mask_BT,
                cfg,
                mb.weight_BT,
                denominator=denom,
            )
            total += loss.item()
        return total

    assert len(pack(rows, 30)) > 3
    assert losses(30) == pytest.approx(losses(10_000), rel=1e-6)
