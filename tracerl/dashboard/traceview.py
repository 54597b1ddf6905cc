"""One rollout as the trace page shows it: its calls as a tree (sub-agents under the call
that spawned them), each call's new messages and tool calls, and its sampled tokens decoded
one by one with the log-prob each was sampled at and the advantage the trainer gives it.

Token ids are decoded with the run's own tokenizer (tokenizer.json of the model that
serves the call's role), through `tokenizers` alone: no torch, no model load. Advantages
are not stored; they are recomputed the way a training step computes them, over the
rollout's group with the run's algorithm (`rows_for`), leaving out what only the step saw
(replayed rollouts, curation bonuses).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, JsonValue

from tracerl.algorithms.advantages import Algorithm
from tracerl.algorithms.rows import rows_for
from tracerl.dashboard.queries import RunStore
from tracerl.types import FinishedRollout, Group, Reward, Rollout, Span, Task

__all__ = ["CallView", "Decoder", "TokenView", "TraceView", "trace_view"]


class TokenView(BaseModel):
    """One sampled token."""

    id: int
    """The token id."""
    text: str
    """The token decoded alone (special tokens included)."""
    logprob: float
    """Its log-probability under the policy that sampled it."""
    advantage: float | None = None
    """The advantage the trainer gives it (None: the call trains on nothing, e.g. its
    rollout has no outcome)."""


class CallView(BaseModel):
    """One model call (span) of the rollout."""

    id: str
    """The span id."""
    seq: int
    """Order of the call within the attempt."""
    depth: int
    """Nesting: 0 for the top agent's calls, 1 for a sub-agent's, ..."""
    parent_span_id: str | None
    """The call whose agent spawned this call's agent."""
    role: str
    """The role (model name) that answered."""
    version: int
    """The policy version that sampled it."""
    messages: list[dict[str, JsonValue]]
    """The messages this call adds to its role's conversation so far (all of them for the
    role's first call)."""
    messages_total: int
    """All messages of the request."""
    response: dict[str, JsonValue]
    """What the agent got back (content, tool_calls)."""
    finish_reason: str
    """stop, length or tool_calls."""
    prompt_tokens: int
    """Prompt length in tokens."""
    prefix_reused: int
    """Prompt tokens reused verbatim from the previous call (token-in/token-out)."""
    prefix_break: str | None
    """Why they could not be, when they could not."""
    temperature: float
    """Sampling temperature."""
    latency_s: float
    """Time in the gateway."""
    tokens: list[TokenView]
    """The sampled tokens."""


class TraceView(BaseModel):
    """The trace page's data for one rollout."""

    rollout: Rollout
    """The store's record (status, attempt, reward, answer, error)."""
    task: Task | None
    """The task it attempted."""
    rewards: list[Reward]
    """Rewards given to its current attempt."""
    calls: list[CallView]
    """Its calls in tree order (each parent before its children, siblings by seq)."""
    group: list[str]
    """Ids of the rollouts of its group, in issue order (for side-by-side views)."""
    step: int | None
    """The step that trained on it, if one did."""
    decoded: bool
    """Whether a tokenizer was found (else token texts are '#<id>')."""


class Decoder:
    """Token id -> text with one tokenizer file, memoised per id (a vocab is small)."""

    _cache: dict[Path, Decoder] = {}
    _lock = threading.Lock()

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self._texts: dict[int, str] = {}

    @classmethod
    def load(cls, path: Path | None) -> Decoder | None:
        """The decoder of a tokenizer.json, built once per file."""
        if path is None:
            return None
        with cls._lock:
            if path not in cls._cache:
                cls._cache[path] = cls(path)
            return cls._cache[path]

    def texts(self, ids: list[int]) -> list[str]:
        """Each id decoded alone (a byte-level piece of a multi-byte character shows as
        the replacement character)."""
        missing = sorted({i for i in ids if i not in self._texts})
        if missing:
            decoded = self._tok.decode_batch([[i] for i in missing], skip_special_tokens=False)
            self._texts.update(zip(missing, decoded, strict=True))
        return [self._texts[i] for i in ids]


def _tree_order(spans: list[Span]) -> list[tuple[Span, int]]:
    """Spans with their depth, each parent before its children (siblings by seq)."""
    ids = {s.id for s in spans}
    children: dict[str | None, list[Span]] = {}
    for s in spans:
        parent = s.parent_span_id if s.parent_span_id in ids else None
        children.setdefault(parent, []).append(s)
    out: list[tuple[Span, int]] = []
    stack = [(s, 0) for s in reversed(children.get(None, []))]
    while stack:
        span, depth = stack.pop()
        out.append((span, depth))
        stack += [(c, depth + 1) for c in reversed(children.get(span.id, []))]
    return out


def _new_messages(span: Span, seen: dict[str, int]) -> list[dict[str, JsonValue]]:
    """The messages of the call past those its role's previous call already had."""
    start = seen.get(span.role, 0)
    seen[span.role] = len(span.messages)
    return span.messages[start:] if start <= len(span.messages) else span.messages


def span_advantages(
    store: RunStore, rollout: Rollout, task: Task | None, algorithm: Algorithm
) -> dict[str, list[float]]:
    """Span id -> per-token advantages of its sampled tokens, recomputed over its group."""
    if not rollout.has_outcome or task is None:
        return {}
    members = store.group(rollout.group_id) if rollout.group_id else [rollout]
    finished = []
    for r in members:
        if r.has_outcome:
            _, _, spans, rewards = store.rollout(r.id)
            finished.append(FinishedRollout(rollout=r, spans=spans, rewards=rewards))
    group = Group(id=rollout.group_id or rollout.id, task=task, rollouts=finished)
    out: dict[str, list[float]] = {}
    lengths = {s.id: len(s.completion_ids) for f in finished if f.id == rollout.id for s in f.spans}
    for row in rows_for([group], algorithm):
        if row.rollout_id != rollout.id:
            continue
        # A row's sampled positions are its spans' completions, in span order.
        sampled = [a for a, m in zip(row.advantages, row.loss_mask, strict=True) if m]
        for span_id in row.span_ids:
            n = lengths.get(span_id, 0)
            out[span_id], sampled = sampled[:n], sampled[n:]
    return out


def trace_view(
    store: RunStore,
    rollout_id: str,
    decoder_for: Callable[[str], Decoder | None],
    algorithm: Algorithm | None,
    step: int | None = None,
) -> TraceView:
    """The trace page's data (KeyError for an unknown rollout). `decoder_for` gives each
    role's decoder; a role without one gets '#<id>' texts."""
    rollout, task, spans, rewards = store.rollout(rollout_id)
    advantages = span_advantages(store, rollout, task, algorithm) if algorithm else {}
    decoders: dict[str, Decoder | None] = {}
    seen: dict[str, int] = {}
    new = {s.id: _new_messages(s, seen) for s in spans}  # in seq order, before reordering
    calls = []
    for span, depth in _tree_order(spans):
        decoder = decoders.setdefault(span.role, decoder_for(span.role))
        texts = decoder.texts(span.completion_ids) if decoder else None
        adv = advantages.get(span.id)
        tokens = [
            TokenView(
                id=t,
                text=texts[i] if texts else f"#{t}",
                logprob=span.logprobs[i],
                advantage=adv[i] if adv and i < len(adv) else None,
            )  # fmt: skip
            for i, t in enumerate(span.completion_ids)
        ]
        calls.append(
            CallView(
                id=span.id,
                seq=span.seq,
                depth=depth,
                parent_span_id=span.parent_span_id,
                role=span.role,
                version=span.policy_version,
                messages=new[span.id],
                messages_total=len(span.messages),
                response=span.response,
                finish_reason=span.finish_reason,
                prompt_tokens=len(span.prompt_ids),
                prefix_reused=span.prefix_reused,
                prefix_break=span.prefix_break,
                temperature=span.temperature,
                latency_s=span.latency_s,
                tokens=tokens,
            )  # fmt: skip
        )
    group = [r.id for r in store.group(rollout.group_id)] if rollout.group_id else [rollout.id]
    return TraceView(
        rollout=rollout, task=task, rewards=rewards, calls=calls, group=group, step=step,
        decoded=any(decoders.values()),
    )  # fmt: skip
