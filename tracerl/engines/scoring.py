"""Log-probs of sampled tokens, computed one way for the engine and for whoever re-scores.

The engine records log_softmax(logits / T)[token] in fp32 before any top-p truncation (T = 1
for greedy requests). `score_completion` recomputes exactly that with one unpadded forward
pass, so a trainer (or a test) can check or recompute the behaviour policy's log-probs.
Both sides call `logprobs_at_temperature`, so they cannot drift apart.

A constrained completion (engines/constrained.py) was sampled from a grammar-masked
distribution; its span records the grammar (`constraint_of`), and `score_completion` given
it masks the logits the same way, token by token, before taking the log-probs.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tracerl.engines.constrained import ConstrainedParams, Grammars, masked
from tracerl.types import Span, effective_temperature

__all__ = [
    "Constraint",
    "constraint_of",
    "effective_temperature",
    "logprobs_at_temperature",
    "score_completion",
]


class Constraint(BaseModel):
    """The grammar a span's completion was sampled under (span.response["constraint"])."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    grammar: str
    """The llguidance grammar the engine masked with."""
    eos_token_ids: list[int]
    """The engine's end tokens: all the grammar allows once it is complete."""


def constraint_of(span: Span) -> Constraint | None:
    """The grammar the span's completion was sampled under; None for a free completion."""
    raw = span.response.get("constraint")
    return Constraint.model_validate(raw) if raw is not None else None


def logprobs_at_temperature(logits_BV: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) over the vocabulary, in fp32; temperature_B must be > 0."""
    return torch.log_softmax(logits_BV.float() / temperature_B.float()[:, None], dim=-1)


@torch.inference_mode()
def score_completion(
    model: PreTrainedModel,
    prompt_ids: list[int],
    completion_ids: list[int],
    temperature: float = 1.0,
    constraint: Constraint | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> list[float]:
    """Log-prob of each completion token given everything before it, at `temperature`,
    under `constraint`'s mask when given (which needs the model's `tokenizer`).

    One forward pass over prompt + completion, no padding; temperature 0 scores at T = 1,
    as the engine records greedy requests.
    """
    if not completion_ids:
        return []
    device = next(model.parameters()).device
    ids_1T = torch.tensor([prompt_ids + completion_ids], dtype=torch.long, device=device)
    # The logits at positions len(prompt)-1 .. end-1 predict the completion tokens.
    n = len(completion_ids)
    logits_NV = model(input_ids=ids_1T, logits_to_keep=n + 1).logits[0, :-1]
    if constraint is not None:
        logits_NV = _masked(logits_NV, completion_ids, constraint, tokenizer)
    temperature_N = torch.full((n,), effective_temperature(temperature), device=device)
    logp_NV = logprobs_at_temperature(logits_NV, temperature_N)
    target_N = ids_1T[0, -n:]
    return logp_NV.gather(1, target_N[:, None])[:, 0].tolist()


def _masked(
    logits_NV: torch.Tensor,
    completion_ids: list[int],
    constraint: Constraint,
    tokenizer: PreTrainedTokenizerBase | None,
) -> torch.Tensor:
    """Each position's logits under the mask the grammar had before that token."""
    if tokenizer is None:
        raise ValueError("scoring a constrained completion needs the model's tokenizer")
    grammars = Grammars(tokenizer, constraint.eos_token_ids, logits_NV.shape[-1])
    params = ConstrainedParams(grammar=constraint.grammar)
    matcher = grammars.matcher(params)
    rows = []
    for i, token in enumerate(completion_ids):
        rows.append(masked([matcher], logits_NV[i : i + 1]))
        assert matcher is not None
        matcher.advance(token)
    return torch.cat(rows)
