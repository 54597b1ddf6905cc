"""How well a model copies demonstrations: the held-out scores SFT trains to a target on
(`score_held_out`, `exact_match`), the mean loss of a model directory on demonstrations,
and the seeded hold-out split. Every score is teacher-forced in fp32 through
`target_logprobs`, which never materialises a big vocabulary's full logits."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracerl.models.demos import Demo, EncodedDemo, collate, encode_all, pad_token_id
from tracerl.models.heads import target_logprobs

__all__ = ["exact_match", "mean_loss", "score_held_out", "split_holdout"]


@torch.no_grad()
def mean_loss(model_dir: str | Path, demos: Sequence[Demo | EncodedDemo], max_len: int) -> float:
    """Mean loss per masked token of the model in `model_dir` over `demos` (fp32)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for e in encode_all(tokenizer, demos):
        ids_BT, attn_BT, labels_BT = collate([e], pad_token_id(tokenizer), max_len)
        logp_N = target_logprobs(model, ids_BT, attn_BT, labels_BT).logp_N
        total -= float(logp_N.sum())
        count += logp_N.numel()
    return total / max(count, 1)


def split_holdout(examples: Sequence, share: float, seed: int) -> tuple[list, list]:
    """(train, held_out): `share` of the examples, at least one and never all, chosen at
    random with `seed`; both keep the examples' order. A share of 0 holds none out."""
    if share <= 0:
        return list(examples), []
    if len(examples) < 2:
        raise ValueError("holding examples out needs at least two of them")
    n_held = min(len(examples) - 1, max(1, round(share * len(examples))))
    held = set(random.Random(seed).sample(range(len(examples)), n_held))
    train = [e for i, e in enumerate(examples) if i not in held]
    return train, [e for i, e in enumerate(examples) if i in held]


@torch.no_grad()
def score_held_out(
    model: torch.nn.Module,
    encoded: Sequence[EncodedDemo],
    pad_id: int,
    max_len: int,
    batch_size: int = 64,
) -> tuple[float, float]:
    """(exact, sampled) over `encoded`, teacher-forced in fp32.

    exact: the share of examples whose every loss-mask token is the model's argmax given
    the ids before it. An example scores 1 exactly when greedy decoding, fed the example's
    own non-assistant turns (tool results, user turns), would write its assistant turns
    token for token: every tool call and the final answer copied.
    sampled: the mean over examples of exp(sum of their masked tokens' log-probs), the
    probability that sampling at temperature 1 writes the same assistant turns.
    Ids past `max_len` are not scored; an example with nothing masked scores 1."""
    if not encoded:
        raise ValueError("no examples to score")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    copied, sampled = 0.0, 0.0
    for i in range(0, len(encoded), batch_size):
        batch = collate(list(encoded[i : i + batch_size]), pad_id, max_len)
        ids_BT, attn_BT, labels_BT = (t.to(device) for t in batch)
        scores = target_logprobs(model, ids_BT, attn_BT, labels_BT)
        rows = ids_BT.shape[0]
        wrong_B = torch.zeros(rows, device=device).index_add_(
            0, scores.row_N, (~scores.top_N).float()
        )
        logp_B = torch.zeros(rows, device=device).index_add_(0, scores.row_N, scores.logp_N)
        copied += float((wrong_B == 0).sum())
        sampled += float(logp_B.exp().sum())
    model.train(was_training)
    return copied / len(encoded), sampled / len(encoded)


def exact_match(
    model: torch.nn.Module,
    encoded: Sequence[EncodedDemo],
    pad_id: int,
    max_len: int,
    batch_size: int = 64,
) -> float:
    """The share of `encoded` greedy decoding would copy whole (`score_held_out`'s exact)."""
    return score_held_out(model, encoded, pad_id, max_len, batch_size)[0]
