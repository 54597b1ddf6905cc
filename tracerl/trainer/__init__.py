"""Trainer: packs training rows into micro-batches, computes the policy loss, updates the
model. It knows no algorithm: advantages and weights arrive written on the rows."""

from tracerl.trainer.loss import (
    LossConfig,
    LossMetrics,
    loss_weights,
    policy_loss,
    token_logprobs,
)
from tracerl.trainer.packing import MicroBatch, pack

__all__ = [
    "LossConfig",
    "LossMetrics",
    "MicroBatch",
    "loss_weights",
    "pack",
    "policy_loss",
    "token_logprobs",
]
