"""The trainer: turns credit-assigned rows into a policy update, algorithm-blind.

It packs rows into micro-batches by token budget, recomputes log-probs under the current
weights, and minimises the PPO-clip surrogate with an importance-sampling correction
(truncated, masked or filtered) against the behaviour log-probs the engine recorded, on all
sampled tokens or only the high-entropy ones (tracerl.trainer.loss). Full fine-tuning or LoRA
(peft); AdamW, gradient clipping, a warmup + constant/cosine schedule; bf16 autocast on CPUs
that have it. The trainer never looks at rewards or groups: advantages and weights arrive
written on the rows. Each optimizer step is `loss_and_grads` (tracerl.trainer.gradients: the
one implementation of a step's loss and backward, which the benches run too) followed by
`apply_gradients`; this module owns the optimizer, the schedule, the proximal pass and LoRA.

A step whose loss or gradient norm is not finite never reaches the optimizer (clipping does
not stop a NaN, and one NaN step poisons every weight): its gradients are dropped, the
optimizer and the schedule do not step, and the update counts it (`nonfinite_steps`) and
logs a warning.
"""

from __future__ import annotations

import copy
import logging
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel
from transformers import AutoModelForCausalLM, PreTrainedModel

from tracerl.precision import Precision, choose_precision, probe_pass, probe_rows, use_bf16
from tracerl.trainer.config import TrainerConfig
from tracerl.trainer.gradients import forward_logprobs, loss_and_grads
from tracerl.trainer.lora import merged_lora_state, with_lora
from tracerl.trainer.loss import LossMetrics
from tracerl.trainer.packing import MicroBatch, pack
from tracerl.types import Transition

log = logging.getLogger("tracerl.trainer")


class TrainMetrics(BaseModel):
    """What one call of `Trainer.train` did."""

    loss: float
    """Mean loss over the optimizer steps taken."""
    grad_norm: float
    """Mean pre-clip gradient norm over the optimizer steps taken."""
    lr: float
    """Learning rate of the last optimizer step."""
    tokens: int
    """Tokens forwarded (padding excluded), per pass."""
    trained_tokens: int
    """Sampled tokens that carry loss."""
    optimizer_steps: int
    """Optimizer steps taken."""
    nonfinite_steps: int = 0
    """Optimizer steps skipped because their loss or gradient norm was not finite (NaN or
    inf): their gradients were dropped, the weights left as they were."""
    wall_s: float
    """Wall time of the update."""
    tokens_per_s: float
    """Forward+backward tokens per second."""
    clip_fraction: float
    """Share of tokens where the PPO clip was active."""
    tis_ratio_mean: float
    """Mean behaviour->proximal importance ratio before the cap."""
    tis_ratio_max: float
    """Largest behaviour->proximal importance ratio."""
    tis_capped_fraction: float
    """Share of tokens whose importance weight was capped."""
    is_masked_fraction: float = 0.0
    """Share of tokens whose importance weight the 'mask'/'filter' mode set to 0."""
    entropy_kept_fraction: float = 1.0
    """Share of tokens kept by the entropy top-q selection (1 when it is off)."""
    entropy: float | None = None
    """Mean entropy of the current policy on sampled tokens, when it was computed (the
    entropy top-q selection is on)."""
    kl_behaviour: float
    """KL(behaviour || current) estimate (k3)."""
    kl_reference: float | None = None
    """KL(current || reference) estimate (k3), when the KL term is on."""

    @classmethod
    def empty(cls) -> TrainMetrics:
        """No update happened (no rows for this policy in the batch)."""
        return cls(
            loss=0.0, grad_norm=0.0, lr=0.0, tokens=0, trained_tokens=0, optimizer_steps=0,
            wall_s=0.0, tokens_per_s=0.0, clip_fraction=0.0, tis_ratio_mean=1.0,
            tis_ratio_max=1.0, tis_capped_fraction=0.0, kl_behaviour=0.0,
        )  # fmt: skip


class Trainer:
    """Holds the trainable policy and its optimizer; `train(rows)` is one update."""

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.model_dir = str(model_dir)
        base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model: PreTrainedModel = with_lora(base, cfg.lora)
        self.model.to(self.device)  # type: ignore[arg-type]
        self.model.train()
        # 'auto' is decided here, once, where the device and the model are known (it may time
        # the model); the rest reads a bool.
        self.precision = self._choose_precision(cfg, device)
        cfg = cfg.model_copy(update={"bf16": self.precision.bf16})
        self.cfg = cfg
        self.optimizer, self.scheduler = self._build_optimizer()
        self.version = 0
        self._rng = random.Random(cfg.seed)
        # The KL reference is the starting policy, kept only when the KL term is on.
        self._reference = _reference(self.model, cfg) if cfg.loss.kl_coef > 0 else None

    def _choose_precision(self, cfg: TrainerConfig, device: str) -> Precision:
        """`cfg.bf16` on this device for this model; `auto` times the trainer's own forward
        and backward pass (`loss_and_grads`) on sample rows in each precision where the
        hardware has native bf16."""
        rows = _sample_rows(self.model, cfg)

        def backward(bf16: bool) -> None:
            loss_and_grads(self.model, rows, cfg.model_copy(update={"bf16": bf16}))

        return choose_precision(cfg.bf16, device, probe_pass(self.model, backward))

    def _build_optimizer(
        self,
    ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
        """AdamW over the trainable parameters and its schedule (a sharded trainer calls
        it again once its parameters are sharded)."""
        cfg = self.cfg
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay
        )
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)

    def _lr_factor(self, step: int) -> float:
        if step < self.cfg.warmup_steps:
            return (step + 1) / self.cfg.warmup_steps
        if self.cfg.schedule == "constant":
            return 1.0
        total = self.cfg.total_steps or 1000
        progress = min(1.0, (step - self.cfg.warmup_steps) / max(1, total))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    def set_lr(self, lr: float) -> None:
        """Make `lr` the peak learning rate from now on: the schedule is rebuilt from the
        config with it, at the step it had reached (its warmup and decay go on from there).
        The one way the rate changes mid-run (`tracerl ctl set trainer.lr`, a rollback)."""
        self.cfg = self.cfg.model_copy(update={"lr": lr})
        step = self.scheduler.last_epoch
        for group in self.optimizer.param_groups:
            group["initial_lr"] = lr  # what a schedule built at a step > 0 starts from
        # Built at step - 1, it takes its first step to `step` (and sets the groups' lr).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, self._lr_factor, last_epoch=step - 1
        )

    def train(self, rows: list[Transition]) -> TrainMetrics:
        """One update: epochs x minibatches optimizer steps over `rows`; version += 1."""
        if not rows:
            raise ValueError("no rows to train on")
        started = time.perf_counter()
        # The proximal policy is the policy before this update. With one optimizer step
        # it equals the current policy, so the forward pass of the step itself gives it.
        proximal = None if self._single_step() else self._proximal(rows)
        losses, norms, metrics = [], [], []
        tokens = skipped = 0
        for _ in range(self.cfg.epochs):
            order = list(range(len(rows)))
            self._rng.shuffle(order)
            for chunk in np.array_split(order, self.cfg.minibatches):
                if len(chunk) == 0:
                    continue
                idx = [int(i) for i in chunk]
                loss, norm, ms, n = self._optimizer_step(rows, idx, proximal)
                tokens += n
                if norm is None:
                    skipped += 1
                    continue
                losses.append(loss)
                norms.append(norm)
                metrics += ms
        if skipped:
            log.warning(
                "update %d: %d of %d optimizer steps skipped: loss or gradient norm not "
                "finite (NaN/inf); their gradients were dropped",
                self.version + 1, skipped, skipped + len(losses),
            )  # fmt: skip
        self.version += 1
        wall = time.perf_counter() - started
        out = _summary(
            rows, losses, norms, metrics, tokens, wall, float(self.scheduler.get_last_lr()[0])
        )
        return out.model_copy(update={"nonfinite_steps": skipped})

    def _single_step(self) -> bool:
        return self.cfg.minibatches == 1 and self.cfg.epochs == 1

    @torch.no_grad()
    def _proximal(self, rows: list[Transition]) -> list[torch.Tensor]:
        """Log-probs of every row under the weights before the update, in row order."""
        out = [torch.empty(0)] * len(rows)
        for mb in pack(rows, self.cfg.micro_batch_tokens):
            logp_BT = forward_logprobs(self.model, mb, use_bf16(self.cfg.bf16, self.device))
            for b, i in enumerate(mb.row_indices):
                out[i] = logp_BT[b, : len(rows[i].input_ids)]
        return out

    def _optimizer_step(
        self, rows: list[Transition], idx: list[int], proximal: list[torch.Tensor] | None
    ) -> tuple[float, float | None, list[LossMetrics], int]:
        """One optimizer step on rows[idx]: (loss, pre-clip norm or None when the step was
        skipped as not finite, loss metrics, tokens forwarded)."""
        picked = [rows[i] for i in idx]
        prox = None if proximal is None else [proximal[i] for i in idx]
        out = loss_and_grads(
            self.model, picked, self.cfg, proximal=prox, reference=self._reference_logprobs
        )
        return out.loss, self.apply_gradients(out.loss), out.metrics, out.tokens

    def apply_gradients(self, loss: float = 0.0) -> float | None:
        """Clip the accumulated gradients and step the optimizer and the schedule, unless
        `loss` or the gradient norm is not finite: then nothing steps. The gradients are
        zeroed either way. Returns the pre-clip norm, None for a skipped step."""
        norm = self._clip_gradients()
        finite = math.isfinite(loss) and math.isfinite(norm)
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm if finite else None

    def _clip_gradients(self) -> float:
        """Clip the trainable parameters' gradients to `grad_clip`; the pre-clip norm."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip))

    @torch.no_grad()
    def _reference_logprobs(self, mb: MicroBatch) -> torch.Tensor | None:
        if self._reference is None:
            return None
        if self.cfg.lora is not None:  # the base model is the adapter-free model
            with self.model.disable_adapter():  # type: ignore[operator]
                return forward_logprobs(self.model, mb, use_bf16(self.cfg.bf16, self.device))
        return forward_logprobs(self._reference, mb, use_bf16(self.cfg.bf16, self.device))

    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights for the engine (LoRA merged in), detached copies."""
        if self.cfg.lora is None:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return merged_lora_state(self.model)

    def save_model(self, out_dir: str | Path) -> None:
        """A standard HF model dir (full FT) or peft adapter dir (LoRA)."""
        self.model.save_pretrained(str(out_dir))

    def load_weights(self, model_dir: str | Path) -> None:
        """Load weights saved by `save_model` (a full model dir, or a LoRA adapter dir)."""
        from safetensors.torch import load_file

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        if self.cfg.lora is not None:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, state)
            return
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or ["lm_head.weight"])
        if unexpected or set(missing) - tied:
            raise ValueError(f"weights in {model_dir} do not fit: {missing=} {unexpected=}")

    def state(self) -> dict:
        """Everything needed to resume exactly (weights are saved separately)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "rng": self._rng.getstate(),
            "torch_rng": torch.get_rng_state(),
        }

    def load_state(self, state: dict) -> None:
        """Restore what `state()` returned."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        self._rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])


def _sample_rows(model: PreTrainedModel, cfg: TrainerConfig) -> list[Transition]:
    """Rows of 512 random tokens, half prompt and half sampled, a micro-batch's worth (fewer
    on a large model: precision.PROBE_FLOPS): what `auto` times the trainer on."""
    seq = min(512, cfg.micro_batch_tokens, model.config.max_position_embeddings or 512)
    count = probe_rows(model, cfg.micro_batch_tokens // seq, seq)
    gen = random.Random(0)
    mask = [0] * (seq // 2) + [1] * (seq - seq // 2)
    return [
        Transition(
            rollout_id=f"probe-{i}",
            group_id="probe",
            task_id="probe",
            role="policy",
            input_ids=[gen.randrange(model.config.vocab_size) for _ in range(seq)],
            loss_mask=mask,
            behaviour_logprobs=[-1.0 * m for m in mask],
            versions=[0 if m else -1 for m in mask],
            advantages=[float(m) for m in mask],
            reward=1.0,
            span_ids=[f"probe-{i}"],
            num_spans=1,
        )  # fmt: skip
        for i in range(count)
    ]


def _reference(model: PreTrainedModel, cfg: TrainerConfig) -> torch.nn.Module:
    """A frozen copy of the starting weights (LoRA needs none: it disables its adapter)."""
    if cfg.lora is not None:
        return model
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _summary(
    rows: list[Transition],
    losses: list[float],
    norms: list[float],
    metrics: list[LossMetrics],
    tokens: int,
    wall: float,
    lr: float,
) -> TrainMetrics:
    def avg(name: str) -> float:
        return float(np.mean([getattr(m, name) for m in metrics])) if metrics else 0.0

    return TrainMetrics(
        loss=float(np.mean(losses)) if losses else 0.0,  # no step taken: nothing to average
        grad_norm=float(np.mean(norms)) if norms else 0.0,
        lr=lr,
        tokens=sum(len(r.input_ids) for r in rows),
        trained_tokens=sum(sum(r.loss_mask) for r in rows),
        optimizer_steps=len(losses),
        wall_s=wall,
        tokens_per_s=tokens / max(wall, 1e-9),
        clip_fraction=avg("clip_fraction"),
        tis_ratio_mean=avg("tis_ratio_mean"),
        tis_ratio_max=max((m.tis_ratio_max for m in metrics), default=0.0),
        tis_capped_fraction=avg("tis_capped_fraction"),
        is_masked_fraction=avg("is_masked_fraction"),
        entropy_kept_fraction=avg("entropy_kept_fraction"),
        entropy=avg("entropy") if metrics and metrics[0].entropy is not None else None,
        kl_behaviour=avg("approx_kl"),
        kl_reference=avg("ref_kl") if metrics and metrics[0].ref_kl is not None else None,
    )
