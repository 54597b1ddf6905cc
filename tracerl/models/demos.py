"""Demonstrations for SFT: the records, reading them from JSONL, and turning them into the
token ids and loss masks training uses.

The mask is exact by construction: each conversation is rendered prefix by prefix with the
model's own chat template, every segment is tokenized on its own, and the ids are
concatenated — the same ids the gateway's token-in/token-out would hand the trainer.
Examples that already are ids (`EncodedDemo`) are used as they are.
"""

from __future__ import annotations

import contextlib
import functools
import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError
from transformers import PreTrainedTokenizerBase

from tracerl.gateway.tito import PromptBuilder
from tracerl.jsonl import read_objects

__all__ = [
    "Demo",
    "EncodedDemo",
    "collate",
    "encode_demo",
    "encode_all",
    "load_demos",
    "pad_token_id",
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


def load_demos(path: str | Path) -> list[Demo]:
    """Read demonstrations from JSONL, one {"messages": [...], "tools": [...]} per line.

    Other keys of a line (an "id", a "family", ...) are bookkeeping and ignored; a line
    that is not a demonstration is a ValueError naming the line and what is wrong."""
    demos = []
    for n, raw in read_objects(path):
        if "messages" not in raw:
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


@functools.lru_cache(maxsize=8)
def _builder(tokenizer: PreTrainedTokenizerBase) -> PromptBuilder:
    """The gateway's renderer for this tokenizer: demos are rendered as the gateway renders
    requests (a template that ignores tools gets them the Hermes way), so SFT trains on the
    prompts the served model will see."""
    return PromptBuilder(tokenizer)


def _segments(tokenizer: PreTrainedTokenizerBase, demo: Demo) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, is_assistant_turn) pieces, cut only where
    an assistant turn starts and ends (where the gateway's token-in/token-out cuts too)."""
    builder = _builder(tokenizer)
    messages = [_dict_arguments(m) for m in demo.messages]
    tools = list(demo.tools) or None
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        # The generation prompt belongs to the prompt, not the completion.
        prompt = builder.render(messages[:i], tools, True)
        pieces.append((_suffix(done, prompt), False))
        full = builder.render(messages[: i + 1], tools, False)
        pieces.append((_suffix(prompt, full), True))
        done = full
    whole = builder.render(messages, tools, False)
    if whole != done:  # messages after the last assistant turn (never trained on)
        pieces.append((_suffix(done, whole), False))
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


def collate(
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


def encode_all(tokenizer: PreTrainedTokenizerBase, demos: Sequence[Demo | EncodedDemo]) -> list:
    """Every example as ids: demos rendered and tokenized, encoded ones as they are."""
    out = [d if isinstance(d, EncodedDemo) else encode_demo(tokenizer, d) for d in demos]
    top = max((max(e.input_ids, default=0) for e in out), default=0)
    if top >= len(tokenizer):  # ids recorded with another tokenizer than the base's
        raise ValueError(f"token id {top} is outside the base model's vocabulary")
    return out


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
