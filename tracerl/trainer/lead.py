"""Rank 0 drives, the other ranks follow: a data-parallel trainer behind one pipeline.

The pipeline (store, engine, checkpoints, metrics) runs once, on rank 0. It holds a
`Leader`, which has `Trainer`'s surface (`train`, `engine_state_dict`, `save_model`,
`load_weights`, `state`, `load_state`, `version`, `cfg`): each call is first broadcast to
the other ranks (its name and arguments, the rows included), then run on rank 0, so every
rank enters the same collective with the same arguments. Ranks 1..N-1 run `follow`, which
executes what rank 0 sends until `Leader.close()`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor

from tracerl.precision import Precision
from tracerl.trainer.config import TrainerConfig
from tracerl.trainer.distributed import DistributedTrainer
from tracerl.trainer.trainer import TrainMetrics
from tracerl.types import Transition

__all__ = ["CALLS", "Leader", "follow"]

CALLS = frozenset(
    {"train", "engine_state_dict", "save_model", "load_weights", "state", "load_state"}
)
"""The methods rank 0 may send: the collectives of `DistributedTrainer`."""
_STOP = "stop"


class Leader:
    """Rank 0's handle on the data-parallel trainer: a `Trainer` to the pipeline."""

    def __init__(self, trainer: DistributedTrainer) -> None:
        if trainer.rank != 0:
            raise ValueError("only rank 0 leads; the other ranks call follow()")
        self.trainer = trainer

    @property
    def version(self) -> int:
        """Updates done (every rank holds the same)."""
        return self.trainer.version

    @property
    def cfg(self) -> TrainerConfig:
        """The trainer's settings."""
        return self.trainer.cfg

    @property
    def precision(self) -> Precision:
        """The arithmetic rank 0 trains in (every rank decides the same on like hardware)."""
        return self.trainer.precision

    @property
    def model_dir(self) -> str:
        """Where the starting weights came from."""
        return self.trainer.model_dir

    def _call(self, name: str, *args: Any) -> Any:
        dist.broadcast_object_list([(name, args)], src=0)
        return getattr(self.trainer, name)(*args)

    def train(self, rows: list[Transition]) -> TrainMetrics:
        """One update over `rows` on every rank."""
        return self._call("train", rows)

    def engine_state_dict(self) -> dict[str, Tensor]:
        """Full weights, gathered here."""
        return self._call("engine_state_dict")

    def save_model(self, out_dir: str | Path) -> None:
        """An HF model dir, written here."""
        self._call("save_model", str(out_dir))

    def load_weights(self, model_dir: str | Path) -> None:
        """Weights read here and broadcast."""
        self._call("load_weights", str(model_dir))

    def state(self) -> dict:
        """Optimizer, schedule and RNG state, gathered here."""
        return self._call("state")

    def load_state(self, state: dict) -> None:
        """Restore a state; the optimizer's is broadcast, not sent as a call argument."""
        dist.broadcast_object_list([("load_state", ({},))], src=0)
        self.trainer.load_state(state)

    def close(self) -> None:
        """Release the followers (their `follow` returns)."""
        dist.broadcast_object_list([(_STOP, ())], src=0)


def follow(trainer: DistributedTrainer) -> int:
    """Run rank 0's calls on this rank until it closes; returns how many were run."""
    done = 0
    while True:
        got: list[Any] = [None]
        dist.broadcast_object_list(got, src=0)
        name, args = got[0]
        if name == _STOP:
            return done
        if name not in CALLS:
            raise ValueError(f"rank 0 sent an unknown call {name!r}")
        getattr(trainer, name)(*args)
        done += 1
