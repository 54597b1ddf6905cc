"""SFT checkpoints: what an interrupted fine-tuning run needs to go on where it stopped.

A long SFT (the skill stage of a start on a slow CPU, a pretrained model) can take an hour;
a kill must not lose it. Every `checkpoint_every` steps the loop writes
<out>/.sft-checkpoint/: the weights (safetensors), the optimizer's and the schedule's
states, and `SftState` (step, losses, held-out checks, timings) as JSON, beside the settings
they were made with. Writes go to a temporary folder renamed into place, so a kill during a
write leaves the previous checkpoint whole. The data order is a pure function of the
settings, so the step number is all the loop needs to continue it.

When the run ends the model is saved to <out>, `sft.json` is written beside it (with the
settings, so a resume can tell the run is done) and the checkpoint is removed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file

from tracerl.models.demos import _Record

if TYPE_CHECKING:
    from tracerl.models.sft import SftResult

__all__ = ["Checkpointer", "HeldOutCheck", "SftState"]

_DIR = ".sft-checkpoint"
_SETTINGS = "sft-settings.json"


class HeldOutCheck(_Record):
    """One score of the held-out examples during training."""

    step: int
    """Optimizer steps taken when scored."""
    exact_match: float
    """Share of the held-out examples greedy decoding copies whole (`exact_match`)."""
    sampled_match: float | None = None
    """Mean probability that sampling at temperature 1 copies a held-out example whole."""


class SftState(BaseModel):
    """How far a run is: everything but the tensors."""

    model_config = ConfigDict(extra="forbid")

    step: int = 0
    """Optimizer steps taken."""
    losses: list[float] = Field(default_factory=list)
    """Loss of every step taken."""
    checks: list[HeldOutCheck] = Field(default_factory=list)
    """Held-out checks so far."""
    tokens: int = 0
    """Non-padding tokens trained on."""
    train_s: float = 0.0
    """Seconds spent in optimizer steps."""
    wall_s: float = 0.0
    """Seconds of the training loop, checks included."""
    done: bool = False
    """A stop condition (target, stop_loss) was met."""
    cooldown_from: int | None = None
    """The step the cooldown began at (the target was reached, or the cap); None before."""
    resumed: int | None = None
    """The step this process resumed at, None when it started from step 0."""


class Checkpointer:
    """Saves and loads the checkpoint of one output dir made with one set of settings."""

    def __init__(self, out: Path, settings: str) -> None:
        self.out = out
        self.dir = out / _DIR
        self.settings = settings

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        state: SftState,
    ) -> None:
        """Write the checkpoint (atomically: a folder renamed over the old one)."""
        tmp = self.out / (_DIR + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(_untied(weights), str(tmp / "model.safetensors"))
        torch.save(
            {"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()},
            tmp / "optimizer.pt",
        )
        (tmp / "state.json").write_text(state.model_dump_json())
        (tmp / _SETTINGS).write_text(self.settings)
        old = self.out / (_DIR + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if self.dir.exists():
            self.dir.rename(old)
        tmp.rename(self.dir)
        shutil.rmtree(old, ignore_errors=True)

    def load(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
    ) -> SftState | None:
        """The saved state, its tensors loaded into the objects; None without a checkpoint.
        ValueError when the checkpoint was made with other settings."""
        if not (self.dir / "state.json").exists():
            return None
        self._same_settings(self.dir / _SETTINGS)
        device = next(model.parameters()).device
        model.load_state_dict(load_file(str(self.dir / "model.safetensors")), strict=False)
        saved = torch.load(self.dir / "optimizer.pt", map_location=device, weights_only=True)
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        state = SftState.model_validate_json((self.dir / "state.json").read_text())
        state.resumed = state.step
        return state

    def finished(self) -> SftResult | None:
        """The result of a run of these settings that already ended in `out`, or None."""
        from tracerl.models.sft import SftResult

        result, settings = self.out / "sft.json", self.out / _SETTINGS
        if not (result.exists() and settings.exists() and (self.out / "config.json").exists()):
            return None
        self._same_settings(settings)
        return SftResult.model_validate_json(result.read_text())

    def finish(self, result: SftResult) -> None:
        """Record the ended run beside its model and drop the checkpoint."""
        (self.out / "sft.json").write_text(result.model_dump_json(indent=1))
        (self.out / _SETTINGS).write_text(self.settings)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _same_settings(self, path: Path) -> None:
        saved = json.loads(path.read_text()) if path.exists() else None
        if saved != json.loads(self.settings):
            now = json.loads(self.settings)
            changed = sorted(k for k in now if (saved or {}).get(k) != now[k])
            raise ValueError(
                f"{path.parent} was made with other settings ({', '.join(changed) or 'unknown'} "
                "differ): resume with the same settings, or choose another output directory"
            )


def _untied(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): copy the repeats."""
    seen: set[int] = set()
    out = {}
    for key, tensor in weights.items():
        ptr = tensor.data_ptr()
        out[key] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return out
