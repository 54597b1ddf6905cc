"""Checkpoints: everything a killed run needs to resume exactly, written atomically.

runs/<name>/checkpoints/step-<k>/ holds each policy's weights (an HF model dir), its
trainer state (optimizer, schedule, RNG; one folder per policy when there are several) and
`pipeline.json`, a typed `PipelineState` (step, the source's and curation's state). A
`latest` pointer is replaced atomically, so a crash mid-write leaves the previous one.

The ids of the rollouts trained on go to an append-only ledger, runs/<name>/trained.jsonl
(a line per step), not into every checkpoint: a checkpoint stays the same size however
long the run. Restoring truncates the ledger to the restored step, so the ledger is always
the history of the weights being trained.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from tracerl.algorithms.curation import CurationState
from tracerl.pipeline.sources import SourceState
from tracerl.trainer.lead import Leader
from tracerl.trainer.trainer import Trainer

__all__ = ["Checkpoints", "PipelineState", "Trainers", "read_ledger"]

Trainers = Trainer | Leader | dict[str, Trainer]
"""One trainer (files at the checkpoint's root; a data-parallel run's rank-0 Leader looks the
same) or several by policy name (a folder each)."""


class PipelineState(BaseModel):
    """What a checkpoint keeps besides the weights and trainer states."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    step: int = 0
    """Steps done (the version each trainer was served under is in its own state)."""
    rollouts_trained: int = 0
    """Rollouts trained on so far."""
    source: SourceState = SourceState()
    """The rollout source's position."""
    curation: CurationState = CurationState()
    """The memory of the curation steps that are on."""


class Checkpoints:
    """runs/<name>/checkpoints/step-<k>/ with a `latest` pointer; the trained-ids ledger."""

    def __init__(self, run_dir: Path, keep: int) -> None:
        self.root = run_dir / "checkpoints"
        self.ledger = run_dir / "trained.jsonl"
        self.keep = keep
        self.pinned: set[int] = set()
        """Steps whose checkpoints pruning keeps (the best held-out one)."""

    @staticmethod
    def _dirs(trainers: Trainers, path: Path) -> list[tuple[Trainer | Leader, Path]]:
        if not isinstance(trainers, dict):
            return [(trainers, path)]
        return [(t, path / name) for name, t in trainers.items()]

    def model_dir(self, step: int, policy: str | None = None) -> Path:
        """Where step `step`'s checkpoint keeps a policy's weights (None: the only one)."""
        base = self.root / f"step-{step}"
        return (base / policy if policy else base) / "model"

    def record(self, step: int, rollout_ids: list[str]) -> None:
        """Append the rollouts trained on at `step` (the step number after it) to the
        ledger."""
        self.ledger.parent.mkdir(parents=True, exist_ok=True)
        with self.ledger.open("a") as f:
            f.write(json.dumps({"step": step, "rollouts": rollout_ids}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def save(self, trainers: Trainers, state: PipelineState) -> Path:
        """Write a checkpoint for `state.step` (the number of steps done)."""
        path = self.root / f"step-{state.step}"
        tmp = self.root / f".step-{state.step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for trainer, where in self._dirs(trainers, tmp):
            trainer.save_model(where / "model")
            torch.save(trainer.state(), where / "trainer.pt")
        (tmp / "pipeline.json").write_text(state.model_dump_json())
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        pointer = self.root / ".latest.tmp"
        pointer.write_text(path.name)
        os.replace(pointer, self.root / "latest")
        self._prune()
        return path

    def _prune(self) -> None:
        done = sorted(
            (p for p in self.root.glob("step-*") if p.is_dir()),
            key=lambda p: int(p.name.split("-")[1]),
        )
        for old in done[: -self.keep]:
            if int(old.name.split("-")[1]) not in self.pinned:
                shutil.rmtree(old, ignore_errors=True)

    def pin(self, step: int) -> None:
        """Keep step `step`'s checkpoint from pruning, and let the one pinned before go."""
        self.pinned = {step}
        self._prune()

    def exists(self, step: int) -> bool:
        """Whether a complete checkpoint of `step` is on disk."""
        return (self.root / f"step-{step}" / "pipeline.json").exists()

    def latest(self) -> Path | None:
        """The newest complete checkpoint, if any."""
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / "pipeline.json").exists() else None

    def restore(self, trainers: Trainers) -> PipelineState:
        """Load the newest checkpoint into the trainer(s) and cut the ledger back to it;
        a fresh state when there is none."""
        path = self.latest()
        state = PipelineState()
        if path is not None:
            for trainer, where in self._dirs(trainers, path):
                trainer.load_weights(where / "model")
                trainer.load_state(torch.load(where / "trainer.pt", weights_only=False))
            state = PipelineState.model_validate_json((path / "pipeline.json").read_text())
        self._truncate_ledger(state.step)
        return state

    def _truncate_ledger(self, step: int) -> None:
        """Drop ledger lines of steps after `step`: their updates died with the process."""
        if not self.ledger.exists():
            return
        keep = [
            line
            for line in self.ledger.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step
        ]
        tmp = self.ledger.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.ledger)


def read_ledger(run_dir: str | Path) -> list[str]:
    """Every rollout id the run's weights were trained on, in order (one per training)."""
    path = Path(run_dir) / "trained.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [rid for line in lines for rid in line["rollouts"]]
