"""Constrained decoding for the transformers engine: a grammar as a per-row logits mask.

A request whose params are `ConstrainedParams` carries an llguidance grammar (JSON of a
schema, or a tool-call format's Lark grammar, built by the gateway). Its row gets a
`Matcher`: before each sampling step the matcher says which tokens keep the completion
inside the grammar, every other logit becomes -inf, and the sampled token advances the
matcher. Once the grammar is complete only an end token is allowed.

The log-prob recorded is the masked distribution's, the one the token was drawn from, so
the behaviour policy of the span is honest; `score_completion` re-applies the same mask
(from the grammar the span records) to reproduce it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import llguidance
import llguidance.hf
import numpy as np
import torch
from pydantic import Field
from transformers import PreTrainedTokenizerBase

from tracerl.types import SamplingParams

__all__ = [
    "ConstrainedParams",
    "Grammars",
    "Matcher",
    "check_grammar",
    "grammar_error",
    "masked",
]


class ConstrainedParams(SamplingParams):
    """SamplingParams whose completion must match a grammar."""

    grammar: str = Field(min_length=1)
    """An llguidance grammar (LLMatcher.grammar_from_json_schema / grammar_from_lark)."""


def grammar_error(grammar: str) -> str:
    """Why the grammar cannot be used ('' when it can), checked without a tokenizer."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else ""


def check_grammar(params: SamplingParams) -> None:
    """A ValueError the caller sees at once when the request's grammar is unusable."""
    grammar = getattr(params, "grammar", None)
    if grammar and (error := grammar_error(grammar)):
        raise ValueError(f"invalid grammar: {error}")


class Matcher:
    """One row's grammar state: which tokens may come next, advanced token by token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos: Sequence[int]) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._eos = list(eos)

    def allowed(self) -> torch.Tensor:
        """A [V] bool mask of the tokens the grammar allows now."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self._vocab].astype(bool)
        mask_V = torch.zeros(self._vocab, dtype=torch.bool)
        mask_V[: allowed.size] = torch.from_numpy(allowed)
        if not mask_V.any():  # a matcher in error allows nothing: let the row end
            mask_V[self._eos] = True
        return mask_V

    def advance(self, token: int) -> None:
        """Feed the sampled token (tokens it refuses put it in its error state)."""
        self._matcher.consume_token(token)


class Grammars:
    """Makes matchers for one tokenizer (its llguidance form is built once, on first use:
    about a second for a large vocabulary)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Sequence[int], vocab_size: int
    ) -> None:
        self._tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self._vocab = vocab_size
        self._ll: llguidance.LLTokenizer | None = None

    def matcher(self, params: SamplingParams) -> Matcher | None:
        """A fresh matcher for the request's grammar; None for an unconstrained request."""
        grammar = getattr(params, "grammar", None)
        if not grammar:
            return None
        if self._ll is None:
            # A copy: the fast tokenizer's backend must not be shared across threads.
            tokenizer = copy.deepcopy(self._tokenizer)
            self._ll = llguidance.hf.from_tokenizer(
                tokenizer,  # type: ignore[arg-type]
                n_vocab=self._vocab,
                eos_token=self._eos,
            )
        matcher = llguidance.LLMatcher(self._ll, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid grammar: {matcher.get_error()}")
        return Matcher(matcher, self._vocab, self._eos)


def masked(matchers: Sequence[Matcher | None], logits_BV: torch.Tensor) -> torch.Tensor:
    """The logits with every token a row's grammar forbids at -inf (rows without a matcher
    unchanged); the input is not modified."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits_BV
    vocab = logits_BV.shape[-1]
    allow_RV = torch.stack([_fit(m.allowed(), vocab) for m in matchers if m is not None])
    out = logits_BV.clone()
    index_R = torch.tensor(rows, device=logits_BV.device)
    out[index_R] = out[index_R].masked_fill(~allow_RV.to(logits_BV.device), float("-inf"))
    return out


def _fit(mask_V: torch.Tensor, vocab: int) -> torch.Tensor:
    """A mask cut or padded (with False) to the logits' width."""
    if mask_V.numel() >= vocab:
        return mask_V[:vocab]
    return torch.cat([mask_V, torch.zeros(vocab - mask_V.numel(), dtype=torch.bool)])
