"""Merging a rollout's calls into one row changes the tokens forwarded, not the update.

A multi-turn rollout whose every prompt extends the previous prompt + completion is one
sequence; `spans_to_transitions` makes it one row instead of one row per call. Each sampled
token then sees the same context, so the loss and every parameter's gradient must equal
those of one row per call, with fewer tokens. Checked on the production path: spans ->
`spans_to_transitions` -> `compute_advantages` -> `loss_and_grads`, the function
`Trainer.train` runs for each optimizer step (fp32, several micro-batches per form).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.rollouts import growing_rollout
from tracerl.algorithms import GRPO, compute_advantages
from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.trainer.gradients import Gradients, loss_and_grads
from tracerl.trainer.trainer import Trainer, TrainerConfig
from tracerl.types import Span, Transition

# Small micro-batches so that both forms accumulate over several, differently packed.
CFG = TrainerConfig(bf16=False, micro_batch_tokens=96)
TOL = 1e-5


def _rows(batch: list[tuple[str, list[Span], float]], per_span: bool) -> list[Transition]:
    """Merged (spans_to_transitions as is) or one row per call; GRPO either way."""
    rows = []
    for group, spans, reward in batch:
        for part in [[s] for s in spans] if per_span else [spans]:
            rows += spans_to_transitions(part, reward, group_id=group, task_id=group)
    return compute_advantages(GRPO(), rows)


def _grads(model: PreTrainedModel, rows: list[Transition]) -> tuple[Gradients, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = loss_and_grads(model, rows, CFG)
    return out, [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _max_rel(ref: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    return max(float((o - r).norm() / r.norm()) for r, o in zip(ref, other, strict=True))


def _sampled_logp(rows: list[Transition], out: Gradients) -> dict[str, list[float]]:
    """Each rollout's sampled-token log-probs, in call order."""
    got: dict[str, list[float]] = {}
    for row, logp in sorted(zip(rows, out.logp_rows, strict=True), key=lambda x: x[0].span_ids):
        mask = torch.tensor(row.loss_mask, dtype=torch.bool)
        got.setdefault(row.rollout_id, []).extend(logp[mask].tolist())
    return got


class Case(NamedTuple):
    batch: list[tuple[str, list[Span], float]]
    """(group id, spans, reward) of each rollout: 2 groups of 4, 3 calls each."""
    model: PreTrainedModel
    """The tiny model in fp32, the behaviour log-probs' source."""
    model_dir: Path
    """Where the tiny model lives (for a Trainer of its own)."""


@pytest.fixture(scope="module")
def case(tiny_model_dir: Path) -> Case:
    torch.manual_seed(0)
    rng = random.Random(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    lengths = {"prompt_len": (6, 10), "completion_len": (2, 6), "turn_len": (2, 5)}
    batch = [
        (f"g{k // 4}", growing_rollout(model, rng, f"r{k}", **lengths), rewards[k])
        for k in range(8)
    ]
    return Case(batch, model, tiny_model_dir)


def test_merged_rows_give_the_same_loss_and_gradients(case: Case) -> None:
    batch, model = case.batch, case.model
    merged, split = _rows(batch, per_span=False), _rows(batch, per_span=True)
    assert len(merged) == 8 and len(split) == 24
    tokens_m = sum(len(r.input_ids) for r in merged)
    assert sum(len(r.input_ids) for r in split) > 1.8 * tokens_m
    assert sum(map(sum, (r.loss_mask for r in merged))) == sum(
        map(sum, (r.loss_mask for r in split))
    )

    out_m, grads_m = _grads(model, merged)
    out_s, grads_s = _grads(model, split)
    assert len(out_m.metrics) > 1 and len(out_s.metrics) > 1  # accumulated over micro-batches
    assert abs(out_m.loss) > 1e-4 and all(float(g.norm()) > 0 for g in grads_m)
    assert abs(out_s.loss - out_m.loss) <= TOL * abs(out_m.loss)
    assert _max_rel(grads_m, grads_s) <= TOL
    logp_m, logp_s = _sampled_logp(merged, out_m), _sampled_logp(split, out_s)
    assert logp_m.keys() == logp_s.keys()
    for rid, values in logp_m.items():
        assert values == pytest.approx(logp_s[rid], abs=TOL)

    # Trainer.train runs this very function: its loss is the one computed above.
    assert Trainer(case.model_dir, CFG).train(merged).loss == pytest.approx(out_m.loss, rel=1e-6)


def test_a_row_that_loses_its_context_changes_the_gradients(case: Case) -> None:
    # The tolerance above is tight enough to see a real difference: rows of later calls
    # that keep only the last few context tokens (what re-tokenizing only the new messages
    # would give) are the same sampled tokens in other contexts.
    batch, model = case.batch, case.model
    cut = [
        (g, [s.model_copy(update={"prompt_ids": s.prompt_ids[-4:]}) for s in spans], r)
        for g, spans, r in batch
    ]
    out_m, grads_m = _grads(model, _rows(batch, per_span=False))
    out_c, grads_c = _grads(model, _rows(cut, per_span=True))
    assert _max_rel(grads_m, grads_c) > 1e-2
    assert abs(out_c.loss - out_m.loss) > 1e-3 * abs(out_m.loss)
