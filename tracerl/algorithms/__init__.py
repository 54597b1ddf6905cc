"""Algorithms: spans of finished rollouts -> training rows (credit assignment), then
advantages and loss weights written by small per-rollout / per-group hooks."""

from tracerl.algorithms.advantages import (
    GRPO,
    RLOO,
    Algorithm,
    DrGRPO,
    Normalize,
    compute_advantages,
)
from tracerl.algorithms.transitions import spans_to_transitions

__all__ = [
    "GRPO",
    "RLOO",
    "Algorithm",
    "DrGRPO",
    "Normalize",
    "compute_advantages",
    "spans_to_transitions",
]
