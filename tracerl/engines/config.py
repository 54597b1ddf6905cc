"""Which engine serves a policy and how (torch-free, so reading a config stays light)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["EngineConfig"]


class EngineConfig(BaseModel):
    """Which engine serves the policy and how."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    kind: Literal["hf"] = "hf"
    """'hf': transformers with continuous batching, on the CPU or a GPU (`device`). The only
    kind in this version: a vLLM engine is not built yet."""
    device: str = "cpu"
    """torch device for the hf engine ("cpu", "cuda", "cuda:1")."""
    max_batch_size: int = Field(default=32, ge=1)
    """Most sequences decoded together."""
    default_max_tokens: int = Field(default=256, ge=1)
    """max_tokens for requests that give none."""
    seed: int = 0
    """Seed of the engine's sampler for unseeded requests."""
