"""The pipeline: the only place that knows both sides, rollouts in and policy updates out.

Modules: `config` (PipelineConfig, TrainConfig; torch-free), `sources` (where batches come
from: sync, async windowed FIFO), `step` (one training step: rows, update, publish,
checkpoint), `run` (a whole run assembled: `train(cfg)`). This package imports nothing so
that reading a config stays light.
"""
