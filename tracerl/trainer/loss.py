"""The policy loss: PPO-clip with a decoupled behaviour-policy correction (truncated,
masked or filtered importance sampling), optional high-entropy token selection, and the
per-token log-probs and entropies it needs.

Three log-probs meet here, all of the token the policy sampled:
- behaviour: what the engine that sampled the token reported (recorded in the span);
- proximal: the trainer's own log-prob before this update (detached), the anchor of the
  PPO trust region; in synchronous training behaviour = proximal up to engine/trainer
  numerics;
- current: the trainer's log-prob now, with gradient.
The PPO ratio is current/proximal; the gap behaviour -> proximal (stale versions, engine
numerics, replayed rollouts) is corrected by a detached importance weight built from
proximal/behaviour: truncated at tis_cap (default), or masked per token, or filtered per
row when it leaves [is_low, is_high] (see `LossConfig.is_mode`).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from tracerl.trainer.config import LossConfig

__all__ = [
    "LossConfig",
    "LossMetrics",
    "entropy_selection",
    "importance_weights",
    "loss_weights",
    "policy_loss",
    "token_entropy",
    "token_logprobs",
]


class LossMetrics(BaseModel):
    """What one loss evaluation measured, over the sampled tokens (unweighted means)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    loss: float
    """The loss value returned with these metrics."""
    num_tokens: int
    """Sampled (mask 1) tokens in the batch."""
    clip_fraction: float
    """Fraction of tokens where the clipped branch of the surrogate is active."""
    tis_ratio_mean: float
    """Mean of exp(proximal - behaviour), before the cap."""
    tis_ratio_max: float
    """Largest exp(proximal - behaviour), before the cap."""
    tis_capped_fraction: float
    """Fraction of tokens whose importance weight was capped (0 when the cap is off, in
    'mask' mode, and for tokens of rows dropped by 'filter')."""
    is_masked_fraction: float
    """Fraction of tokens whose importance weight was set to 0 by the 'mask' or 'filter'
    mode (0 in 'truncate' mode)."""
    entropy_kept_fraction: float
    """Fraction of tokens kept by the entropy top-q selection (1 when it is off)."""
    approx_kl: float
    """KL(behaviour || current), k3 estimator: mean of r - 1 - log r, r = current/behaviour."""
    ref_kl: float | None = None
    """KL(current || reference), k3 estimator, when reference log-probs were given."""
    entropy: float | None = None
    """Mean token entropy, when the caller passed one."""


def token_logprobs(
    logits_BTV: Tensor,
    input_ids_BT: Tensor,
    temperature: float | Tensor = 1.0,
    chunk_size: int = 1024,
) -> Tensor:
    """Log-prob of each input token given the ones before it, in fp32.

    logits_BTV: [B, T, V] model outputs (position t predicts token t+1).
    input_ids_BT: [B, T]. temperature: a float or a [B] tensor (one per row).
    Returns logp_BT: [B, T], logp[:, t] = log p(input_ids[:, t] | input_ids[:, :t]);
    logp[:, 0] = 0. Positions are processed `chunk_size` at a time so only one chunk is
    ever upcast to fp32.
    """
    B, T, _ = logits_BTV.shape
    temp = temperature.view(-1, 1, 1) if isinstance(temperature, Tensor) else temperature
    targets_BT1 = input_ids_BT[:, 1:].unsqueeze(-1)
    parts = [logits_BTV.new_zeros(B, 1, dtype=torch.float32)]
    for s in range(0, T - 1, chunk_size):
        e = min(s + chunk_size, T - 1)  # the last position predicts nothing
        x_BCV = logits_BTV[:, s:e].float() / temp
        picked_BC = x_BCV.gather(-1, targets_BT1[:, s:e]).squeeze(-1)
        parts.append(picked_BC - torch.logsumexp(x_BCV, dim=-1))
    return torch.cat(parts, dim=1)


def loss_weights(
    mask_BT: Tensor, weight_BT: Tensor | None, aggregation: Literal["token", "sequence"]
) -> Tensor:
    """Per-token weights W_BT of the loss mean: loss = sum(W * l) / sum(W).

    'token': W = weight * mask. 'sequence': W = weight * mask / (row's sampled tokens), so
    each row counts by its weight whatever its length. A trainer that accumulates over
    micro-batches sums W over all of them and passes that as `denominator`.
    """
    m_BT = mask_BT.to(torch.promote_types(mask_BT.dtype, torch.float32))
    W_BT = m_BT if weight_BT is None else weight_BT * m_BT
    if aggregation == "sequence":
        W_BT = W_BT / m_BT.sum(dim=1, keepdim=True).clamp(min=1.0)
    return W_BT


@torch.no_grad()
def token_entropy(
    logits_BTV: Tensor,
    temperature: float | Tensor = 1.0,
    chunk_size: int = 1024,
) -> Tensor:
    """Entropy of the distribution each token was drawn from, aligned like `token_logprobs`.

    logits_BTV: [B, T, V]; temperature: a float or a [B] tensor.
    Returns ent_BT: [B, T] (fp32, detached), ent[:, t] = H(softmax(logits[:, t-1] / temp)),
    the entropy of the prediction of token t; ent[:, 0] = 0. Chunked like `token_logprobs`.
    """
    B, T, _ = logits_BTV.shape
    temp = temperature.view(-1, 1, 1) if isinstance(temperature, Tensor) else temperature
    parts = [logits_BTV.new_zeros(B, 1, dtype=torch.float32)]
    for s in range(0, T - 1, chunk_size):
        e = min(s + chunk_size, T - 1)
        logp_BCV = torch.log_softmax(logits_BTV[:, s:e].float() / temp, dim=-1)
        parts.append(-(logp_BCV.exp() * logp_BCV).sum(dim=-1))
    return torch.cat(parts, dim=1)


def entropy_selection(entropy_BT: Tensor, mask_BT: Tensor, top_q: float | None) -> Tensor:
    """Bool [B, T]: the sampled tokens whose entropy is among the top `top_q` fraction.

    k = ceil(top_q x sampled tokens) (at least 1); a token is kept when its entropy is >= the
    k-th largest sampled entropy, so ties at the threshold are all kept. None keeps every
    sampled token.
    """
    m_BT = mask_BT.bool()
    vals = entropy_BT.detach()[m_BT]
    if top_q is None or vals.numel() == 0:
        return m_BT
    # The epsilon keeps float dust (0.3 * 10 = 3.0000000000000004) from adding a token.
    k = max(1, math.ceil(top_q * vals.numel() - 1e-9))
    threshold = torch.topk(vals, k).values[-1]
    return m_BT & (entropy_BT.detach() >= threshold)


def importance_weights(
    log_w_BT: Tensor, mask_BT: Tensor, cfg: LossConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """The detached behaviour -> proximal weight of each token under `cfg.is_mode`.

    log_w_BT: [B, T] log w = proximal - behaviour (0 where mask_BT is 0).
    Returns (weight_BT, masked_BT, capped_BT): the weight each token's surrogate is
    multiplied by, which sampled tokens the mode set to 0, and which were capped.
    """
    m_BT = mask_BT.bool()
    w_BT = torch.exp(log_w_BT)
    none_BT = torch.zeros_like(m_BT)
    if cfg.tis_cap is None:
        truncated_BT, capped_BT = torch.ones_like(w_BT), none_BT
    else:
        truncated_BT, capped_BT = w_BT.clamp(max=cfg.tis_cap), (w_BT > cfg.tis_cap) & m_BT
    if cfg.is_mode == "truncate":
        return truncated_BT, none_BT, capped_BT
    if cfg.is_mode == "mask":
        out_BT = ((w_BT < cfg.is_low) | (w_BT > cfg.is_high)) & m_BT
        return torch.where(out_BT, 0.0, w_BT), out_BT, none_BT
    # filter: the row's mean log-weight is the log of its geometric-mean weight.
    n_B1 = m_BT.sum(dim=1, keepdim=True).clamp(min=1)
    mean_B1 = torch.where(m_BT, log_w_BT, 0.0).sum(dim=1, keepdim=True) / n_B1
    drop_B1 = (mean_B1 < math.log(cfg.is_low)) | (mean_B1 > math.log(cfg.is_high))
    out_BT = drop_B1 & m_BT
    return torch.where(out_BT, 0.0, truncated_BT), out_BT, capped_BT & ~out_BT


def policy_loss(
    logp_BT: Tensor,
    proximal_logp_BT: Tensor,
    behaviour_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    cfg: LossConfig,
    weight_BT: Tensor | None = None,
    ref_logp_BT: Tensor | None = None,
    *,
    denominator: float | Tensor | None = None,
    entropy_BT: Tensor | None = None,
) -> tuple[Tensor, LossMetrics]:
    """PPO-clip surrogate with a decoupled importance-sampling correction; returns
    (loss, metrics).

    All inputs are [B, T] and aligned with the input ids (see `token_logprobs`); only
    positions with mask_BT = 1 count, other positions may hold anything.
      ratio_t = exp(logp - proximal)
      surr_t  = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
      is_t    = importance_weights(proximal - behaviour): min(w, tis_cap) by default,
                see LossConfig.is_mode for 'mask' and 'filter'                 (detached)
      keep_t  = 1, or with entropy_top_q: 1 on the top-q sampled tokens of this call by
                entropy_BT, 0 on the rest (`entropy_selection`)
      l_t     = keep_t * (is_t * surr_t + kl_coef * k3 estimate of KL(current || ref))
      loss    = sum(W * l) / denominator,  W = loss_weights(mask, weight, aggregation)
    `denominator` defaults to sum(W) of this batch; pass the sum over all micro-batches of
    one optimizer step (or a constant) to accumulate gradients across micro-batches.
    entropy_BT (detached) is required by entropy_top_q and reported as a metric when given.
    Gradient flows into logp_BT only.
    """
    if cfg.kl_coef and ref_logp_BT is None:
        raise ValueError("kl_coef > 0 needs ref_logp_BT")
    if cfg.entropy_top_q is not None and entropy_BT is None:
        raise ValueError("entropy_top_q needs entropy_BT")
    m_BT = mask_BT.bool()
    # Zero the unmasked positions first: they may hold padding whose exp overflows.
    logp = torch.where(m_BT, logp_BT, 0.0)
    prox = torch.where(m_BT, proximal_logp_BT.detach(), 0.0)
    # A NaN behaviour log-prob is unknown (a token trained under another prompt than it was
    # sampled with: algorithms/transitions.py): weighted as if the proximal policy sampled it.
    beh_BT = behaviour_logp_BT.detach()
    beh = torch.where(m_BT, torch.where(beh_BT.isnan(), prox, beh_BT), 0.0)
    adv = torch.where(m_BT, adv_BT, 0.0)

    ratio = torch.exp(logp - prox)
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    surr = -torch.minimum(ratio * adv, clipped * adv)
    is_w, masked, capped = importance_weights(prox - beh, m_BT, cfg)
    per_token = is_w * surr
    ref_kl = None
    if ref_logp_BT is not None:
        ref_kl = _k3(torch.where(m_BT, ref_logp_BT.detach(), 0.0) - logp)
        per_token = per_token + cfg.kl_coef * ref_kl
    kept = m_BT
    if entropy_BT is not None:
        entropy_BT = torch.where(m_BT, entropy_BT.detach(), 0.0)
        kept = entropy_selection(entropy_BT, m_BT, cfg.entropy_top_q)
        per_token = torch.where(kept, per_token, 0.0)

    W_BT = loss_weights(mask_BT, weight_BT, cfg.aggregation)
    denom = W_BT.sum() if denominator is None else denominator
    loss = (W_BT * per_token).sum() / torch.as_tensor(denom).clamp(min=1e-8)
    metrics = _metrics(
        loss,
        m_BT,
        ratio,
        adv,
        torch.exp(prox - beh),
        cfg,
        logp - beh,
        ref_kl,
        entropy_BT,
        masked=masked,
        capped=capped,
        kept=kept,
    )
    return loss, metrics


def _k3(log_r: Tensor) -> Tensor:
    """k3 estimator of KL(p || q) from log_r = log q - log p on samples of p."""
    return torch.exp(log_r) - 1.0 - log_r


@torch.no_grad()
def _metrics(
    loss: Tensor,
    m_BT: Tensor,
    ratio: Tensor,
    adv: Tensor,
    is_ratio: Tensor,
    cfg: LossConfig,
    log_r_cur_beh: Tensor,
    ref_kl: Tensor | None,
    entropy_BT: Tensor | None,
    *,
    masked: Tensor,
    capped: Tensor,
    kept: Tensor,
) -> LossMetrics:
    m = m_BT.float()
    n = m.sum().clamp(min=1.0)

    def mean(x: Tensor) -> Tensor:
        return (x.float() * m).sum() / n

    hi = (ratio > 1.0 + cfg.clip_high) & (adv > 0)
    lo = (ratio < 1.0 - cfg.clip_low) & (adv < 0)
    zero = torch.zeros((), device=m.device)
    # One stack and one .tolist(): a single device sync for all metrics, unpacked by name.
    named = {
        "loss": loss.detach().float(),
        "clip_fraction": mean(hi | lo),
        "tis_ratio_mean": mean(is_ratio),
        "tis_ratio_max": torch.where(m_BT, is_ratio, 0.0).max() if m_BT.any() else zero,
        "tis_capped_fraction": mean(capped),
        "approx_kl": mean(_k3(log_r_cur_beh)),
        "ref_kl": mean(ref_kl) if ref_kl is not None else zero,
        "entropy": mean(entropy_BT) if entropy_BT is not None else zero,
        "num_tokens": m.sum(),
        "is_masked_fraction": mean(masked),
        "entropy_kept_fraction": mean(kept),
    }
    v = dict(zip(named, torch.stack(list(named.values())).tolist(), strict=True))
    return LossMetrics(
        loss=v["loss"],
        num_tokens=int(v["num_tokens"]),
        clip_fraction=v["clip_fraction"],
        tis_ratio_mean=v["tis_ratio_mean"],
        tis_ratio_max=v["tis_ratio_max"],
        tis_capped_fraction=v["tis_capped_fraction"],
        is_masked_fraction=v["is_masked_fraction"],
        entropy_kept_fraction=v["entropy_kept_fraction"] if v["num_tokens"] else 1.0,
        approx_kl=v["approx_kl"],
        ref_kl=v["ref_kl"] if ref_kl is not None else None,
        entropy=v["entropy"] if entropy_BT is not None else None,
    )
