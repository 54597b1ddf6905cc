"""Builds tracerl's tiny embedded model: a locally trained tokenizer plus a random-init Llama.

The result is a standard HF model directory (safetensors + tokenizer + generation config),
so everything downstream loads it with AutoModelForCausalLM / AutoTokenizer exactly as it
would any other local model directory. Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from tracerl.models.template import END, PAD
from tracerl.models.tokenizer import train_tokenizer

__all__ = ["TinyModelConfig", "build_tiny_model"]


class TinyModelConfig(BaseModel):
    """Shape of the tiny model and its tokenizer (defaults: ~1.85M parameters)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = 400
    """Target BPE vocabulary size, special tokens and the 256 byte tokens included."""
    hidden_size: int = 192
    """Width of the residual stream."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads (hidden_size must be divisible by it)."""
    intermediate_size: int = 512
    """Width of the SwiGLU MLP."""
    max_position: int = 512
    """Longest sequence (prompt + completion) the model is built for, in tokens."""
    tie_embeddings: bool = True
    """Share input embedding and output head weights (a large share of a tiny model)."""
    seed: int = 0
    """Seed of the weight initialisation; the same seed and texts give the same model."""


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(token_id, int)
    return token_id


def build_tiny_model(
    out_dir: str | Path, texts: Iterable[str], cfg: TinyModelConfig | None = None
) -> Path:
    """Train a tokenizer on `texts`, init a Llama of shape `cfg`, save both to `out_dir`."""
    cfg = cfg or TinyModelConfig()
    tokenizer = train_tokenizer(texts, vocab_size=cfg.vocab_size)
    eos_id = _token_id(tokenizer, END)
    pad_id = _token_id(tokenizer, PAD)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings=cfg.tie_embeddings,
        # The template has no BOS token; bos = eos only matters for generation from nothing.
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
