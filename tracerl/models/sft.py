"""Supervised warm start: fine-tune a causal LM on demonstration conversations.

Loss falls only on what the model would have sampled: the assistant turns' content,
tool-call text and closing end token. The mask is exact by construction: each conversation
is rendered prefix by prefix with the model's own chat template, every segment is tokenized
on its own, and the ids are concatenated — the same ids the gateway's token-in/token-out
would hand the trainer. Works for any local HF model dir whose template is prefix-stable.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
import warnings
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    get_cosine_schedule_with_warmup,
)

from tracerl.models.template import render_chat
from tracerl.models.tiny import TinyModelConfig, build_tiny_model

__all__ = [
    "Demo",
    "EncodedDemo",
    "SftConfig",
    "SftResult",
    "encode_demo",
    "load_demos",
    "sft",
    "sft_new_or_base",
]


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Demo(_Record):
    """One demonstration: a conversation in OpenAI chat format and the tools it was given."""

    messages: list[dict[str, JsonValue]]
    """system / user / assistant (content and/or tool_calls) / tool messages, in order."""
    tools: list[dict[str, JsonValue]] = Field(default_factory=list)
    """Tool schemas in OpenAI format ({"type": "function", "function": {...}})."""


class EncodedDemo(_Record):
    """A demonstration as token ids and the positions the loss falls on."""

    input_ids: list[int]
    """Concatenated ids of the rendered conversation's segments."""
    loss_mask: list[bool]
    """True on the ids of assistant turns (content, tool calls, closing end token)."""


class SftConfig(_Record):
    """How to fine-tune."""

    steps: int = 1000
    """Optimizer steps at most; the learning-rate schedule spans this many."""
    stop_loss: float | None = None
    """Stop once the mean loss of the last log_every steps is below this; None trains
    all `steps`."""
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


class SftResult(_Record):
    """What one fine-tuning run did."""

    out_dir: str
    """The saved HF model dir (model + tokenizer)."""
    steps: int
    """Optimizer steps taken."""
    stopped_early: bool
    """Whether stop_loss ended training before cfg.steps."""
    final_loss: float
    """Mean loss per assistant token over the last log_every steps."""
    losses: list[float]
    """Loss of every step, in order."""
    wall_s: float
    """Wall time of the training loop (loading and saving excluded)."""
    tokens_per_s: float
    """Non-padding tokens processed per second in the training loop."""


def load_demos(path: str | Path) -> list[Demo]:
    """Read demonstrations from JSONL, one {"messages": [...], "tools": [...]} per line.

    Other keys of a line (an "id", a "family", ...) are bookkeeping and ignored; a line
    that is not a demonstration is a ValueError naming the line and what is wrong."""
    demos = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(raw, dict) or "messages" not in raw:
            raise ValueError(f'{path}:{n}: each line must be an object with "messages"')
        try:
            demos.append(
                Demo.model_validate({k: raw[k] for k in ("messages", "tools") if k in raw})
            )
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(part) for part in err["loc"])
            raise ValueError(f"{path}:{n}: {where}: {err['msg']}") from None
    if not demos:
        raise ValueError(f"{path}: no demonstrations")
    return demos


def _dict_arguments(message: dict[str, JsonValue]) -> dict[str, JsonValue]:
    """The message with tool-call arguments given as JSON text parsed into dicts."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    fixed: list[JsonValue] = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            # Unparseable text is left as is; the template emits it verbatim.
            with contextlib.suppress(json.JSONDecodeError):
                fn = {**fn, "arguments": json.loads(str(fn["arguments"]))}
            call = {**call, "function": fn}  # type: ignore[dict-item]
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def _render(tokenizer: PreTrainedTokenizerBase, messages: list, tools: list, gen: bool) -> str:
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=gen
    )
    assert isinstance(text, str)
    return text


def _segments(tokenizer: PreTrainedTokenizerBase, demo: Demo) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, is_assistant_turn) pieces."""
    messages = [_dict_arguments(m) for m in demo.messages]
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        is_assistant = message.get("role") == "assistant"
        if is_assistant:  # the generation prompt belongs to the prompt, not the completion
            prompt = _render(tokenizer, messages[:i], demo.tools, gen=True)
            pieces.append((_suffix(done, prompt), False))
            done = prompt
        full = _render(tokenizer, messages[: i + 1], demo.tools, gen=False)
        pieces.append((_suffix(done, full), is_assistant))
        done = full
    return pieces


def _suffix(prefix: str, text: str) -> str:
    if not text.startswith(prefix):
        raise ValueError("chat template is not prefix-stable; cannot mask assistant turns")
    return text[len(prefix) :]


def encode_demo(tokenizer: PreTrainedTokenizerBase, demo: Demo) -> EncodedDemo:
    """Token ids of the demo and the loss mask over its assistant turns."""
    segments = _segments(tokenizer, demo)
    ids: list[int] = []
    mask: list[bool] = []
    for text, is_assistant in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [is_assistant] * len(piece)
    whole = tokenizer("".join(t for t, _ in segments), add_special_tokens=False)
    if whole["input_ids"] != ids:
        # Still trainable (these are the ids the gateway would record), but worth knowing.
        warnings.warn("tokenizing the whole render differs from its segments", stacklevel=2)
    return EncodedDemo(input_ids=ids, loss_mask=mask)


def _batch(
    encoded: list[EncodedDemo], pad_id: int, max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input_ids_BT, attention_mask_BT and labels_BT (-100 off the mask)."""
    length = min(max_len, max(len(e.input_ids) for e in encoded))
    ids_BT = torch.full((len(encoded), length), pad_id, dtype=torch.long)
    attn_BT = torch.zeros((len(encoded), length), dtype=torch.long)
    labels_BT = torch.full((len(encoded), length), -100, dtype=torch.long)
    for b, e in enumerate(encoded):
        ids = torch.tensor(e.input_ids[:length])
        keep = torch.tensor(e.loss_mask[:length])
        ids_BT[b, : len(ids)] = ids
        attn_BT[b, : len(ids)] = 1
        labels_BT[b, : len(ids)] = torch.where(keep, ids, -100)
    return ids_BT, attn_BT, labels_BT


def _order(n: int, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """Batches of demo indices: reshuffled epochs, as many as the steps need."""
    rng = random.Random(seed)
    flat: list[int] = []
    while len(flat) < steps * batch_size:
        epoch = list(range(n))
        rng.shuffle(epoch)
        flat += epoch
    return [flat[s * batch_size : (s + 1) * batch_size] for s in range(steps)]


def sft(
    base_dir: str | Path, demos: list[Demo], out_dir: str | Path, cfg: SftConfig | None = None
) -> SftResult:
    """Fine-tune the HF model in `base_dir` on `demos` and save model + tokenizer to `out_dir`."""
    cfg = cfg or SftConfig()
    if not demos:
        raise ValueError("no demonstrations")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    encoded = [encode_demo(tokenizer, d) for d in demos]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = get_cosine_schedule_with_warmup(optimizer, cfg.warmup, cfg.steps)
    model.train()
    losses: list[float] = []
    tokens = 0
    start = time.perf_counter()
    bar = tqdm(_order(len(encoded), cfg.steps, cfg.batch_size, cfg.seed), disable=not cfg.progress)
    for step, indices in enumerate(bar):
        ids_BT, attn_BT, labels_BT = _batch([encoded[i] for i in indices], pad_id, cfg.max_len)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = model(input_ids=ids_BT, attention_mask=attn_BT, labels=labels_BT).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += int(attn_BT.sum())
        recent = sum(losses[-cfg.log_every :]) / cfg.log_every
        if (step + 1) % cfg.log_every == 0:
            bar.set_postfix(loss=f"{recent:.3f}")
        if cfg.stop_loss is not None and len(losses) >= cfg.log_every and recent < cfg.stop_loss:
            break
    wall_s = time.perf_counter() - start
    bar.close()
    model.eval()
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tail = losses[-cfg.log_every :]
    return SftResult(
        out_dir=str(out),
        steps=len(losses),
        stopped_early=len(losses) < cfg.steps,
        final_loss=sum(tail) / len(tail) if tail else math.nan,
        losses=losses,
        wall_s=wall_s,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
    )


def sft_new_or_base(
    demos: list[Demo], out_dir: str | Path, base_dir: str | Path | None, cfg: SftConfig
) -> SftResult:
    """`sft` from `base_dir`, or with none from a new tiny model whose tokenizer is trained on
    the demos' text, saved beside the output as <out_dir>-base (what `tracerl sft` does)."""
    if base_dir is None:
        out = Path(out_dir)
        base_dir = out.with_name(out.name + "-base")
        texts = [render_chat(d.messages, d.tools) for d in demos]
        build_tiny_model(base_dir, texts, TinyModelConfig())
    return sft(base_dir, demos, out_dir, cfg)
