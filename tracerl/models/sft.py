"""Supervised warm start: fine-tune a causal LM on demonstration conversations.

Loss falls only on what the model would have sampled: the assistant turns' content,
tool-call text and closing end token. The mask is exact by construction: each conversation
is rendered prefix by prefix with the model's own chat template, every segment is tokenized
on its own, and the ids are concatenated — the same ids the gateway's token-in/token-out
would hand the trainer. Works for any local HF model dir whose template is prefix-stable.

Examples that already are ids (`EncodedDemo`: recorded traces, ADP with its token ids)
skip rendering and are trained on as they are (`tracerl sft --from-traces`). The records,
their loading and their encoding live in tracerl.models.demos.

With `holdout` a seeded share of the examples is kept out of training and scored every
`eval_every` steps by `exact_match`; with `target` training stops once that score reaches it.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import Field
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    get_cosine_schedule_with_warmup,
)

from tracerl.models.demos import (
    Demo,
    EncodedDemo,
    _Record,
    collate,
    encode_all,
    encode_demo,
    load_demos,
    pad_token_id,
)
from tracerl.models.template import render_chat
from tracerl.models.tiny import TinyModelConfig, build_tiny_model

__all__ = [
    "Demo",
    "EncodedDemo",
    "HeldOutCheck",
    "SftConfig",
    "SftResult",
    "collate",
    "encode_demo",
    "exact_match",
    "load_demos",
    "mean_loss",
    "sft",
    "sft_new_or_base",
    "split_holdout",
]


class SftConfig(_Record):
    """How to fine-tune."""

    steps: int = Field(default=1000, ge=1)
    """Optimizer steps at most; the learning-rate schedule spans this many."""
    stop_loss: float | None = None
    """Stop once the mean loss of the last log_every steps is below this; None trains
    all `steps`."""
    holdout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Share of the examples kept out of training (chosen with `seed`) and scored by
    `exact_match` every eval_every steps and at the end; 0 holds none out."""
    target: float | None = Field(default=None, gt=0.0, le=1.0)
    """Stop at the first check whose held-out exact match is at least this (needs a
    holdout); `steps` is then the cap. None trains all `steps`."""
    eval_every: int = Field(default=50, ge=1)
    """Steps between held-out checks."""
    batch_size: int = 16
    """Conversations per step."""
    lr: float = 2e-3
    """Peak learning rate (AdamW); 3e-3 already makes the tiny model's runs erratic."""
    warmup: int = 10
    """Steps of linear warmup before cosine decay to zero."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    max_len: int = 256
    """Conversations are truncated to this many tokens."""
    seed: int = 0
    """Seed of the data order."""
    bf16: bool = True
    """bf16 autocast for forward/backward (weights stay fp32): 1.1-1.35x the tokens/s of
    fp32 for the tiny model on one thread of this AVX512-BF16 CPU (bench/sft_curve.py)."""
    log_every: int = 10
    """Steps between progress-bar loss updates; final_loss averages the last this many."""
    progress: bool = True
    """Show a tqdm progress bar."""


class HeldOutCheck(_Record):
    """One score of the held-out examples during training."""

    step: int
    """Optimizer steps taken when scored."""
    exact_match: float
    """Share of the held-out examples copied exactly (`exact_match`)."""


class SftResult(_Record):
    """What one fine-tuning run did."""

    out_dir: str
    """The saved HF model dir (model + tokenizer)."""
    steps: int
    """Optimizer steps taken."""
    stopped_early: bool
    """Whether stop_loss or target ended training before cfg.steps."""
    final_loss: float
    """Mean loss per assistant token over the last log_every steps."""
    losses: list[float]
    """Loss of every step, in order."""
    wall_s: float
    """Wall time of the training loop, held-out checks included (loading and saving
    excluded)."""
    tokens_per_s: float
    """Non-padding tokens trained on per second (held-out checks excluded)."""
    held_out: list[HeldOutCheck] = Field(default_factory=list)
    """Held-out exact match at each check, in order; empty without a holdout."""
    target: float | None = None
    """cfg.target: the held-out exact match that was to end training; None without one."""
    target_reached: bool | None = None
    """Whether a check reached `target` before the step cap; None without a target."""


def _order(n: int, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """Batches of demo indices: reshuffled epochs, as many as the steps need."""
    rng = random.Random(seed)
    flat: list[int] = []
    while len(flat) < steps * batch_size:
        epoch = list(range(n))
        rng.shuffle(epoch)
        flat += epoch
    return [flat[s * batch_size : (s + 1) * batch_size] for s in range(steps)]


@torch.no_grad()
def mean_loss(model_dir: str | Path, demos: Sequence[Demo | EncodedDemo], max_len: int) -> float:
    """Mean loss per masked token of the model in `model_dir` over `demos` (fp32)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for e in encode_all(tokenizer, demos):
        ids_BT, attn_BT, labels_BT = collate([e], pad_token_id(tokenizer), max_len)
        n = int((labels_BT[:, 1:] != -100).sum())  # the first token is never a target
        total += model(input_ids=ids_BT, attention_mask=attn_BT, labels=labels_BT).loss.item() * n
        count += n
    return total / max(count, 1)


def split_holdout(examples: Sequence, share: float, seed: int) -> tuple[list, list]:
    """(train, held_out): `share` of the examples, at least one and never all, chosen at
    random with `seed`; both keep the examples' order. A share of 0 holds none out."""
    if share <= 0:
        return list(examples), []
    if len(examples) < 2:
        raise ValueError("holding examples out needs at least two of them")
    n_held = min(len(examples) - 1, max(1, round(share * len(examples))))
    held = set(random.Random(seed).sample(range(len(examples)), n_held))
    train = [e for i, e in enumerate(examples) if i not in held]
    return train, [e for i, e in enumerate(examples) if i in held]


@torch.no_grad()
def exact_match(
    model: torch.nn.Module,
    encoded: Sequence[EncodedDemo],
    pad_id: int,
    max_len: int,
    batch_size: int = 64,
) -> float:
    """Share of `encoded` whose every loss-mask token is the model's argmax given the ids
    before it (teacher forcing, fp32).

    An example scores 1 exactly when greedy decoding, fed the example's own non-assistant
    turns (tool results, user turns), would write its assistant turns token for token: every
    tool call and the final answer copied. Ids past `max_len` are not scored; an example
    with nothing masked scores 1. One forward pass per `batch_size` examples."""
    if not encoded:
        raise ValueError("no examples to score")
    was_training = model.training
    model.eval()
    copied = 0
    for i in range(0, len(encoded), batch_size):
        ids_BT, attn_BT, labels_BT = collate(list(encoded[i : i + batch_size]), pad_id, max_len)
        logits_BTV = model(input_ids=ids_BT, attention_mask=attn_BT).logits
        # Position t predicts token t+1; only masked targets must match.
        wrong_BT = (logits_BTV[:, :-1].argmax(-1) != ids_BT[:, 1:]) & (labels_BT[:, 1:] != -100)
        copied += int((~wrong_BT.any(dim=1)).sum())
    model.train(was_training)
    return copied / len(encoded)


def _step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: SftConfig,
) -> float:
    """One optimizer step on a collated batch; its loss."""
    ids_BT, attn_BT, labels_BT = batch
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
        loss = model(input_ids=ids_BT, attention_mask=attn_BT, labels=labels_BT).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def sft(
    base_dir: str | Path,
    demos: Sequence[Demo | EncodedDemo],
    out_dir: str | Path,
    cfg: SftConfig | None = None,
) -> SftResult:
    """Fine-tune the HF model in `base_dir` on `demos` and save model + tokenizer to `out_dir`
    (with cfg.holdout, on the demos it does not hold out)."""
    cfg = cfg or SftConfig()
    if not demos:
        raise ValueError("no demonstrations")
    if cfg.target is not None and cfg.holdout <= 0:
        raise ValueError("a held-out target needs a holdout share above 0")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    pad_id = pad_token_id(tokenizer)
    encoded, held = split_holdout(encode_all(tokenizer, demos), cfg.holdout, cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = get_cosine_schedule_with_warmup(optimizer, cfg.warmup, cfg.steps)
    model.train()
    losses: list[float] = []
    checks: list[HeldOutCheck] = []
    tokens, check_s = 0, 0.0
    postfix: dict[str, str] = {}
    start = time.perf_counter()
    bar = tqdm(_order(len(encoded), cfg.steps, cfg.batch_size, cfg.seed), disable=not cfg.progress)
    for step, indices in enumerate(bar, start=1):
        batch = collate([encoded[i] for i in indices], pad_id, cfg.max_len)
        losses.append(_step(model, optimizer, schedule, batch, cfg))
        tokens += int(batch[1].sum())
        recent = sum(losses[-cfg.log_every :]) / cfg.log_every
        if step % cfg.log_every == 0:
            postfix["loss"] = f"{recent:.3f}"
        score = None
        if held and (step % cfg.eval_every == 0 or step == cfg.steps):
            t0 = time.perf_counter()
            score = exact_match(model, held, pad_id, cfg.max_len)
            check_s += time.perf_counter() - t0
            checks.append(HeldOutCheck(step=step, exact_match=score))
            postfix["held_out"] = f"{score:.3f}"
        bar.set_postfix(postfix, refresh=False)
        if cfg.target is not None and score is not None and score >= cfg.target:
            break
        if cfg.stop_loss is not None and len(losses) >= cfg.log_every and recent < cfg.stop_loss:
            break
    wall_s = time.perf_counter() - start
    bar.close()
    model.eval()
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tail = losses[-cfg.log_every :]
    result = SftResult(
        out_dir=str(out),
        steps=len(losses),
        stopped_early=len(losses) < cfg.steps,
        final_loss=sum(tail) / len(tail) if tail else math.nan,
        losses=losses,
        wall_s=wall_s,
        tokens_per_s=tokens / (wall_s - check_s) if wall_s > check_s else 0.0,
        held_out=checks,
        target=cfg.target,
        target_reached=_reached(checks, cfg.target),
    )
    # Beside the model, for scripts deciding what to do next (another pass, the habit stage).
    (out / "sft.json").write_text(result.model_dump_json(indent=1))
    return result


def _reached(checks: list[HeldOutCheck], target: float | None) -> bool | None:
    if target is None:
        return None
    return any(c.exact_match >= target for c in checks)


def sft_new_or_base(
    demos: Sequence[Demo | EncodedDemo],
    out_dir: str | Path,
    base_dir: str | Path | None,
    cfg: SftConfig,
) -> SftResult:
    """`sft` from `base_dir`, or with none from a new tiny model whose tokenizer is trained on
    the demos' text, saved beside the output as <out_dir>-base (what `tracerl sft` does).
    Examples given as ids need the base whose tokenizer made them."""
    if base_dir is None:
        if any(isinstance(d, EncodedDemo) for d in demos):
            raise ValueError("examples given as token ids need --base (the model that made them)")
        out = Path(out_dir)
        base_dir = out.with_name(out.name + "-base")
        texts = [render_chat(d.messages, d.tools) for d in demos if isinstance(d, Demo)]
        build_tiny_model(base_dir, texts, TinyModelConfig())
    return sft(base_dir, demos, out_dir, cfg)
