"""How the policy is updated: the trainer's and the loss's settings.

Kept apart from the trainer's code so that reading a config (the CLI, `--help`, a run's
config.json) never imports torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tracerl.precision import Bf16Setting

__all__ = ["LoraSettings", "LossConfig", "TrainerConfig"]


class LossConfig(BaseModel):
    """How the policy loss is computed."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    clip_low: float = 0.2
    """The ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.28
    """The ratio is clipped above at 1 + clip_high (DAPO clip-higher: > clip_low keeps
    exploration alive on low-probability tokens)."""
    tis_cap: float | None = 2.0
    """Cap of the behaviour -> proximal importance weight w = exp(proximal - behaviour) in
    the 'truncate' and 'filter' modes; None there turns the correction off (weight 1)."""
    is_mode: Literal["truncate", "mask", "filter"] = "truncate"
    """How w = exp(proximal - behaviour) weights each sampled token's surrogate:
    'truncate' (TIS): min(w, tis_cap), every token kept;
    'mask' (MIS): w where is_low <= w <= is_high, 0 (token masked) elsewhere; no cap;
    'filter' (F-TIS): a row whose mean log-weight over its sampled tokens (the log of the
    geometric-mean weight) lies outside [log is_low, log is_high] is dropped whole (weight 0
    on all its tokens); the kept rows' tokens get min(w, tis_cap).
    Masked or dropped tokens stay in the loss denominator as zero-weight samples, so the
    loss scale does not jump with the masked share and micro-batch accumulation is exact."""
    is_low: float = Field(default=0.5, gt=0)
    """Lower bound of the accepted importance weight ('mask': per token; 'filter': per row,
    geometric mean)."""
    is_high: float = Field(default=2.0, gt=0)
    """Upper bound of the accepted importance weight (see is_low)."""
    entropy_top_q: float | None = Field(default=None, gt=0, le=1)
    """When set, only the top-q fraction of the sampled tokens of one loss call (one
    micro-batch), ranked by the current policy's entropy at that position (detached), carry
    loss; the others are masked (zero loss, kept in the denominator). None: all tokens."""
    aggregation: Literal["token", "sequence"] = "token"
    """'token': weighted mean over all sampled tokens of the batch; 'sequence': mean over
    each row's sampled tokens, then weighted mean over rows."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimator to a reference policy; 0 turns it off."""

    @model_validator(mode="after")
    def _bounds(self) -> LossConfig:
        if not self.is_low <= 1.0 <= self.is_high:
            raise ValueError("is_low <= 1 <= is_high is required (weight 1 must be accepted)")
        return self


class LoraSettings(BaseModel):
    """A LoRA adapter instead of full fine-tuning."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    r: int = Field(default=16, ge=1)
    """Adapter rank."""
    alpha: int = 32
    """Scaling numerator (scale = alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    """Module names that get adapters."""


class TrainerConfig(BaseModel):
    """How the policy is updated from a batch of rows."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    lr: float = Field(default=1e-4, gt=0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Max global gradient norm."""
    warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps of linear warmup."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning rate after warmup: constant, or cosine decay to 10% over total_steps."""
    total_steps: int | None = Field(default=None, ge=1)
    """Optimizer steps the cosine schedule spans; default: a run's steps x minibatches x
    epochs (filled in by tracerl.train), else 1000."""
    minibatches: int = Field(default=1, ge=1)
    """Optimizer steps per batch of rows (PPO mini-batches; >1 makes clipping bite)."""
    epochs: int = Field(default=1, ge=1)
    """Passes over each batch."""
    micro_batch_tokens: int = Field(default=8192, ge=64)
    """Padded tokens per forward/backward micro-batch (gradients accumulate across them)."""
    prefix_sharing: bool = False
    """Forward the prefix that a step's rows share (a group's system prompt, tool schemas
    and task) once per micro-batch and each row's branch on its KV cache
    (tracerl.trainer.prefix), with the loss and gradients of one row per rollout. Off
    until measured on real models; with entropy_top_q set, which selects tokens per
    micro-batch, the plain micro-batches are kept. The data-parallel trainer packs plainly."""
    bf16: Bf16Setting = "auto"
    """bf16 autocast for forward/backward (weights and log-probs stay fp32): 'auto' where the
    device computes bf16 natively (a CUDA GPU that supports it, a CPU with AVX512-BF16 or
    AMX), fp32 elsewhere (on an AVX2 CPU bf16 is emulated, ~30x slower); true; false."""
    lora: LoraSettings | None = None
    """Train a LoRA adapter instead of all weights."""
    loss: LossConfig = LossConfig()
    """The policy loss."""
    seed: int = 0
    """Seed of mini-batch shuffling."""
