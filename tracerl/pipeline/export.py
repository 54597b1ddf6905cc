"""A run's outputs: the model it hands over, chosen on held-out success, and the last one.

With `guard.keep_best`, the checkpoint of the best held-out evaluation was pinned during
the run. When it is not the last step's, both are evaluated on the whole held-out set and
the better one becomes `model/` (`models/<policy>/` with several policies); the last
weights are kept beside it as `model-last/` (`models-last/<policy>/`). A run that made its
model worse thus hands back the better weights it had, and says so in summary.json.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from tracerl.pipeline.guards import Guards, load_checkpoint_weights
from tracerl.pipeline.step import Pipeline, Policy

__all__ = ["Exported", "export_outputs"]


class Exported(BaseModel):
    """Which weights went where, with their held-out success on the whole held-out set."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    model_dir: str
    """The run's model: `model/` (or `models/`)."""
    model_step: int
    """Training steps behind the exported model (0: the start)."""
    model_success: float
    """Its held-out success."""
    last_dir: str
    """The last step's weights: `model-last/` when they differ from the model, else the
    model's own dir."""
    last_step: int
    """Training steps done."""
    last_success: float
    """The last weights' held-out success."""
    best_step: int | None = None
    """The step of the best periodic held-out evaluation, when that was not the last step
    (None: the last weights were the best evaluated)."""
    best_rescored: float | None = None
    """That checkpoint's held-out success measured again at export, on the same tasks as the
    last weights' (its periodic score was the largest of several noisy ones, so it reads
    high): the score that chose between it and the last weights."""


def export_outputs(
    pipeline: Pipeline,
    guards: Guards,
    run_dir: Path,
    last_success: float,
    evaluate_all: Callable[[str], float],
) -> Exported:
    """Save the model (best on held-out) and the last weights; `evaluate_all(label)` is
    the held-out success of the weights being served."""
    model = run_dir / ("model" if len(pipeline.policies) == 1 else "models")
    step, best = pipeline.step, guards.best.step
    if not guards.cfg.keep_best or best is None or best == step:
        _save_all(pipeline.policies, model)
        return Exported(
            model_dir=str(model), model_step=step, model_success=last_success,
            last_dir=str(model), last_step=step, last_success=last_success,
        )  # fmt: skip
    last = model.with_name(model.name + "-last")
    _save_all(pipeline.policies, last)
    load_checkpoint_weights(pipeline, best)
    rescored = evaluate_all(f"eval best (step {best})")
    chosen, chosen_success = best, rescored
    if rescored < last_success:  # measured on the same tasks, the last one is better
        _load_saved(pipeline, last)
        chosen, chosen_success = step, last_success
    _save_all(pipeline.policies, model)
    return Exported(
        model_dir=str(model), model_step=chosen, model_success=chosen_success,
        last_dir=str(last), last_step=step, last_success=last_success,
        best_step=best, best_rescored=rescored,
    )  # fmt: skip


def _load_saved(pipeline: Pipeline, out: Path) -> None:
    """Load the weights saved under `out` (by `_save_all`) back into the trainers."""
    several = len(pipeline.policies) > 1
    for p in pipeline.policies:
        p.trainer.load_weights(out / p.name if several else out)


def _save_all(policies: list[Policy], out: Path) -> None:
    """`out` for a single policy, `out/<policy>/` for each of several."""
    if len(policies) == 1:
        _save_outputs(policies[0], out)
        return
    for policy in policies:
        _save_outputs(policy, out / policy.name)


def _save_outputs(policy: Policy, out: Path) -> None:
    """`out`: an HF model dir (full FT) or a peft adapter (LoRA); with LoRA also
    `<out>-merged`, a plain HF model dir any tool (or `tracerl eval`) loads directly."""
    tokenizer = policy.engine.tokenizer
    trainer = policy.trainer
    trainer.save_model(out)
    tokenizer.save_pretrained(str(out))
    if trainer.cfg.lora is None:
        return
    from transformers import AutoModelForCausalLM

    merged_dir = out.with_name(out.name + "-merged")
    merged = AutoModelForCausalLM.from_pretrained(trainer.model_dir)
    merged.load_state_dict(trainer.engine_state_dict())
    merged.save_pretrained(str(merged_dir))
    tokenizer.save_pretrained(str(merged_dir))
