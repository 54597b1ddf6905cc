"""Engines turn prompt token ids into sampled completion ids and their log-probs.

`tracerl.engines.hf.HFEngine` (transformers, batched) is imported from its module so that
importing this package stays free of torch.
"""

from tracerl.engines.base import Engine
from tracerl.engines.stub import StubEngine

__all__ = ["Engine", "StubEngine"]
