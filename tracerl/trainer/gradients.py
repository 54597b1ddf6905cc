"""One optimizer step's loss and gradients: the part of an update others must not re-derive.

`loss_and_grads` packs rows into micro-batches, recomputes their log-probs under the model's
current weights, evaluates `policy_loss` with one denominator over all micro-batches and
back-propagates each, so the accumulated gradients equal those of one big batch. `Trainer`
calls it for every optimizer step, then clips and steps; the benches (bench/merge.py,
bench/mfu.py, bench/prefix_tree.py) and tests/test_merge_equivalence.py call this same
function, so what they measure is what trains. With `TrainerConfig.prefix_sharing` the rows
that share a prefix are forwarded as trees (tracerl.trainer.prefix): same loss, same
denominator, fewer tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from tracerl.precision import use_bf16
from tracerl.trainer.chunked import chunked_logits
from tracerl.trainer.config import TrainerConfig
from tracerl.trainer.loss import (
    LossMetrics,
    loss_weights,
    policy_loss,
    token_entropy,
    token_logprobs,
)
from tracerl.trainer.packing import MicroBatch, pack
from tracerl.trainer.prefix import TreeBatch, forwarded_tokens, plan, tree_logits
from tracerl.types import Transition

__all__ = [
    "Gradients",
    "backward_micro_batches",
    "forward_logprobs",
    "loss_and_grads",
    "loss_denominator",
    "model_logits",
]

Stage = Callable[[str], None]
"""Called at the end of each stage: 'pack' once, then 'forward', 'logprobs', 'loss' and
'backward' per micro-batch (bench/mfu.py times them; the default does nothing)."""
Reference = Callable[[MicroBatch], Tensor | None]
"""Log-probs [B, T] of a micro-batch under the KL reference policy, or None (no KL term)."""


class Gradients(NamedTuple):
    """What `loss_and_grads` computed; the gradients themselves are in the parameters' .grad."""

    loss: float
    """The step's loss (micro-batch losses share one denominator, so they add up)."""
    metrics: list[LossMetrics]
    """One per micro-batch."""
    tokens: int
    """Tokens forwarded, padding excluded."""
    logp_rows: list[Tensor]
    """Each row's log-probs under the weights used ([T_row], detached), in row order."""


def _untimed(stage: str) -> None:
    """The default stage hook: nothing is measured."""


def _no_reference(mb: MicroBatch) -> None:
    """The default reference: the KL term is off."""


def model_logits(model: torch.nn.Module, mb: MicroBatch, bf16: bool) -> Tensor:
    """logits_BTV of a micro-batch, under bf16 autocast when asked (on the model's device)."""
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        return model(
            input_ids=mb.input_ids_BT.to(device), attention_mask=mb.attention_mask_BT.to(device)
        ).logits


def forward_logprobs(model: torch.nn.Module, mb: MicroBatch, bf16: bool) -> Tensor:
    """logp_BT of every token of a micro-batch given the ones before it (`token_logprobs`),
    the logits made a chunk of positions at a time (tracerl.trainer.chunked)."""
    device = next(model.parameters()).device
    ids_BT, temp_B = mb.input_ids_BT.to(device), mb.temperature_B.to(device)
    logits = chunked_logits(model, mb, bf16)
    if isinstance(logits, Tensor):
        return token_logprobs(logits, ids_BT, temp_B)
    return logits.per_token(token_logprobs, ids_BT, temp_B)


def loss_and_grads(
    model: torch.nn.Module,
    rows: list[Transition],
    cfg: TrainerConfig,
    *,
    proximal: list[Tensor] | None = None,
    reference: Reference = _no_reference,
    stage: Stage = _untimed,
) -> Gradients:
    """The loss of `rows` under `model` and its backward pass; gradients add to .grad.

    proximal: each row's log-probs before the update ([T_row], detached); None when the
    model's weights are still those (one optimizer step per batch): then the forward pass
    of this step gives them. The caller zeroes .grad before and steps the optimizer after.
    """
    batches: Sequence[MicroBatch | TreeBatch]
    if _shares_prefixes(cfg):
        batches = plan(rows, cfg.micro_batch_tokens)
        plain = [tb.mb for tb in batches]
    else:
        batches = plain = pack(rows, cfg.micro_batch_tokens)
    # One denominator for the whole optimizer step, so accumulating gradients over
    # micro-batches gives the same update as one big batch.
    denom = loss_denominator(plain, cfg)
    stage("pack")
    return backward_micro_batches(model, rows, batches, cfg, denom, proximal, reference, stage)


def _shares_prefixes(cfg: TrainerConfig) -> bool:
    """Whether to forward rows as trees: asked for, and the loss does not depend on which
    rows share a micro-batch (the entropy top-q selection does)."""
    return cfg.prefix_sharing and cfg.loss.entropy_top_q is None


def loss_denominator(batches: list[MicroBatch], cfg: TrainerConfig) -> float:
    """sum(W) over the micro-batches, W = `loss_weights`: the loss is sum(W * l) / this."""
    agg = cfg.loss.aggregation
    return sum(float(loss_weights(mb.loss_mask_BT, mb.weight_BT, agg).sum()) for mb in batches)


def backward_micro_batches(
    model: torch.nn.Module,
    rows: list[Transition],
    batches: Sequence[MicroBatch | TreeBatch],
    cfg: TrainerConfig,
    denom: float,
    proximal: list[Tensor] | None = None,
    reference: Reference = _no_reference,
    stage: Stage = _untimed,
) -> Gradients:
    """Forward, loss over `denom` and backward of each micro-batch of `rows`, in order.

    `loss_and_grads` passes its rows' own denominator; a data-parallel rank passes the one
    of every rank's rows, so the ranks' gradients add up to the whole batch's. A
    `TreeBatch` is forwarded as a tree (tracerl.trainer.prefix), a `MicroBatch` plainly.
    """
    total, metrics, tokens = 0.0, [], 0
    logp_rows: list[Tensor] = [torch.empty(0)] * len(rows)
    for batch in batches:
        tb = batch if isinstance(batch, TreeBatch) else TreeBatch(batch, 0)
        loss, m, logp_BT = _micro_batch(model, tb, cfg, denom, proximal, reference, stage)
        total += loss
        metrics.append(m)
        tokens += forwarded_tokens(tb)
        mb = tb.mb
        for b, i in enumerate(mb.row_indices):
            logp_rows[i] = logp_BT[b, : len(rows[i].input_ids)]
    return Gradients(total, metrics, tokens, logp_rows)


def _micro_batch(
    model: torch.nn.Module,
    tb: TreeBatch,
    cfg: TrainerConfig,
    denom: float,
    proximal: list[Tensor] | None,
    reference: Reference,
    stage: Stage,
) -> tuple[float, LossMetrics, Tensor]:
    """Forward, loss and backward of one micro-batch; returns (loss, metrics, logp_BT)."""
    mb = tb.mb
    bf16 = use_bf16(cfg.bf16, next(model.parameters()).device)
    logits = tree_logits(model, tb, bf16) if tb.shared else chunked_logits(model, mb, bf16)
    stage("forward")
    device = next(model.parameters()).device
    ids_BT, temp_B = mb.input_ids_BT.to(device), mb.temperature_B.to(device)

    def per_token(fn: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        if isinstance(logits, Tensor):
            return fn(logits, ids_BT, temp_B)
        return logits.per_token(fn, ids_BT, temp_B)

    logp_BT = per_token(token_logprobs)
    # Entropies cost a second pass over the logits: only when the selection needs them.
    with_entropy = cfg.loss.entropy_top_q is not None
    entropy_BT = per_token(lambda x, _ids, t: token_entropy(x, t)) if with_entropy else None
    stage("logprobs")
    prox_BT = logp_BT.detach() if proximal is None else _gather(proximal, mb, logp_BT)
    loss, metrics = policy_loss(
        logp_BT,
        prox_BT,
        mb.behaviour_logp_BT.to(device),
        mb.adv_BT.to(device),
        mb.loss_mask_BT.to(device),
        cfg.loss,
        mb.weight_BT.to(device),
        reference(mb),
        denominator=denom,
        entropy_BT=entropy_BT,
    )
    stage("loss")
    loss.backward()
    stage("backward")
    return float(loss.detach()), metrics, logp_BT.detach()


def _gather(proximal: list[Tensor], mb: MicroBatch, like_BT: Tensor) -> Tensor:
    """The micro-batch's rows of `proximal`, right-padded with 0 like like_BT."""
    out_BT = torch.zeros_like(like_BT)
    for b, i in enumerate(mb.row_indices):
        out_BT[b, : proximal[i].shape[0]] = proximal[i]
    return out_BT
