"""`tracerl sft`: a supervised warm start from demonstrations, before any RL."""

from __future__ import annotations

from rich.console import Console

from tracerl.entrypoints import quiet_model_loading
from tracerl.entrypoints.config import SftCommand
from tracerl.models.sft import SftConfig, load_demos, sft_new_or_base


def main(cfg: SftCommand, console: Console) -> None:
    """Fine-tune `base` (or a new tiny model) on the demos and save it to `out`."""
    quiet_model_loading()
    # The flags left unset keep SftConfig's defaults.
    given = cfg.model_dump(include={"steps", "stop_loss", "lr", "seed"}, exclude_none=True)
    result = sft_new_or_base(load_demos(cfg.demos), cfg.out, cfg.base, SftConfig(**given))
    console.print(
        f"saved {result.out_dir}: {result.steps} steps, final loss {result.final_loss:.3f}, "
        f"{result.tokens_per_s:.0f} tok/s"
    )
