"""Synthetic multi-turn rollouts scored by a real model, for the tests that check two paths
compute the same update (data-parallel vs single trainer, merged vs per-call rows, the
one-screen loop vs the full trainer)."""

from __future__ import annotations

import random

from transformers import PreTrainedModel

from tracerl.engines.scoring import score_completion
from tracerl.types import Span


def policy_span(
    rid: str, seq: int, prompt: list[int], completion: list[int], logprobs: list[float]
) -> Span:
    """Call `seq` of rollout `rid`: first attempt, policy role, policy version 0."""
    return Span(
        id=f"{rid}-{seq}",
        rollout_id=rid,
        attempt=1,
        seq=seq,
        role="policy",
        policy_version=0,
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=logprobs,
    )


def growing_rollout(
    model: PreTrainedModel,
    rng: random.Random,
    rid: str,
    *,
    prompt_len: tuple[int, int],
    completion_len: tuple[int, int],
    turn_len: tuple[int, int],
) -> list[Span]:
    """Three calls; each prompt is the previous prompt + completion + a new tool turn.

    Lengths are drawn uniformly from the inclusive (low, high) ranges. The log-probs are the
    model's own plus noise: a slightly stale behaviour policy, so the importance weights are
    not all 1.
    """
    vocab = model.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))]
    spans = []
    for seq in range(3):
        completion = [rng.randrange(vocab) for _ in range(rng.randint(*completion_len))]
        true = score_completion(model, prompt, completion)
        behaviour = [x + rng.uniform(-0.3, 0.3) for x in true]
        spans.append(policy_span(rid, seq, prompt, completion, behaviour))
        prompt = prompt + completion + [rng.randrange(vocab) for _ in range(rng.randint(*turn_len))]
    return spans
