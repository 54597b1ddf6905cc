"""Engines turn prompt token ids into sampled completion ids and their log-probs."""

from tracerl.engines.base import Engine

__all__ = ["Engine"]
