"""Data-parallel trainer: does N ranks' update equal one process's, and how fast is it here?

The tiny model (hidden 192, 4 layers, built locally) trains on rows of calculator length
(uniform 100-300 tokens, ~half sampled, random advantages) in one process (`Trainer`, as
many threads as ranks) and on N ranks (`DistributedTrainer`, FSDP2 over gloo, one thread
each, spawned by tracerl.trainer.launch on loopback). Both take the same updates: a
warm-up update on a quarter of the rows, then `reps` updates on all of them (fp32, so the
comparison is not blurred by bf16).

Measures
- dp_max_rel_diff: the largest relative difference between the two runs, over each
  update's loss and pre-clip gradient norm and, after the last update, every parameter
  tensor (|p_N - p_1| / |p_1|, L2 norms).
- tokens_per_s_1 / tokens_per_s_n: forward+backward tokens per second of the timed
  updates (best of `reps`), padding excluded, as `TrainMetrics.tokens_per_s` counts them;
  speedup = tokens_per_s_n / tokens_per_s_1. On a 2-core machine shared with others no
  speedup is expected: both runs use the same cores, and the ranks add collectives.
The last line printed is one JSON object (DpReport).

    .venv/bin/python bench/dp.py [--ranks 2 --rows 32 --reps 2]

Runs with OMP_WAIT_POLICY=PASSIVE unless the caller sets it (see `tracerl.ensure_passive_omp`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers.utils import logging as hf_logging

from tracerl import ensure_passive_omp
from tracerl.models import TinyModelConfig, build_tiny_model, render_chat
from tracerl.trainer.distributed import DistributedTrainer
from tracerl.trainer.launch import spawn
from tracerl.trainer.trainer import Trainer, TrainerConfig, TrainMetrics
from tracerl.types import Transition

CALC = Path(__file__).resolve().parent.parent / "examples" / "calculator"
sys.path.insert(0, str(CALC))
from expert import demonstrations  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_rows import calculator_rows  # noqa: E402

CFG = TrainerConfig(lr=1e-3, bf16=False, micro_batch_tokens=2048)
"""fp32, several micro-batches per rank."""


class DpConfig(BaseModel):
    """What the bench runs."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    ranks: int = 2
    """Data-parallel ranks (one thread each); the single process gets as many threads."""
    rows: int = 32
    """Rows per update."""
    reps: int = 2
    """Timed updates after the warm-up one."""
    seed: int = 0
    """Seed of the rows."""


class DpReport(BaseModel):
    """What the bench measured (the last line printed, as JSON)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    ranks: int
    """Data-parallel ranks."""
    dp_max_rel_diff: float
    """Largest relative difference of loss, grad norm or any parameter, N ranks vs 1."""
    tokens_per_s_1: float
    """Forward+backward tokens/s of one process (best timed update)."""
    tokens_per_s_n: float
    """Forward+backward tokens/s of N ranks together (best timed update)."""
    speedup: float
    """tokens_per_s_n / tokens_per_s_1."""
    tokens_per_update: int
    """Tokens of one timed update."""


def updates(trainer: Trainer, rows: list[Transition], reps: int) -> list[TrainMetrics]:
    """The warm-up update, then `reps` timed ones (the same on 1 process and N ranks)."""
    return [trainer.train(rows[: max(1, len(rows) // 4)])] + [
        trainer.train(rows) for _ in range(reps)
    ]


def on_each_rank(model_dir: str, rows: list[Transition], reps: int) -> dict[str, Any]:
    """One rank of the N-rank run; every rank returns its metrics and the full weights."""
    hf_logging.set_verbosity_error()
    trainer = DistributedTrainer(model_dir, CFG)
    metrics = updates(trainer, rows, reps)
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    return {"metrics": metrics, "params": full}


def _rel(ref: float, other: float) -> float:
    return abs(other - ref) / max(abs(ref), 1e-12)


def run(cfg: DpConfig) -> DpReport:
    hf_logging.set_verbosity_error()
    texts = [render_chat(d["messages"], d["tools"]) for d in demonstrations(300, seed=7)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", texts, TinyModelConfig())
        torch.set_num_threads(cfg.ranks)
        single = Trainer(model_dir, CFG)
        vocab = single.model.config.vocab_size
        rng = random.Random(cfg.seed)
        rows = calculator_rows(rng, cfg.rows, vocab, weight=lambda _: rng.uniform(0.5, 1.5))
        one = updates(single, rows, cfg.reps)
        ranks = spawn(on_each_rank, cfg.ranks, str(model_dir), rows, cfg.reps)
    many, params = ranks[0]["metrics"], ranks[0]["params"]
    diffs = [_rel(a.loss, b.loss) for a, b in zip(one, many, strict=True)]
    diffs += [_rel(a.grad_norm, b.grad_norm) for a, b in zip(one, many, strict=True)]
    ref = single.model.state_dict()
    diffs += [float((params[k] - v).norm() / v.norm()) for k, v in ref.items()]
    tps_1 = max(m.tokens_per_s for m in one[1:])
    tps_n = max(m.tokens_per_s for m in many[1:])
    return DpReport(
        ranks=cfg.ranks, dp_max_rel_diff=max(diffs), tokens_per_s_1=tps_1,
        tokens_per_s_n=tps_n, speedup=tps_n / tps_1, tokens_per_update=one[-1].tokens,
    )  # fmt: skip


def main() -> None:
    ensure_passive_omp()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, field in DpConfig.model_fields.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=field.default)
    cfg = DpConfig(**vars(parser.parse_args()))
    report = run(cfg)
    print(f"{cfg.ranks} ranks vs 1 process: max rel diff {report.dp_max_rel_diff:.2e}")
    print(f"tokens/s: 1 process {report.tokens_per_s_1:.0f}, {cfg.ranks} ranks "
          f"{report.tokens_per_s_n:.0f} (x{report.speedup:.2f})")  # fmt: skip
    print(json.dumps(report.model_dump()))


if __name__ == "__main__":
    main()
