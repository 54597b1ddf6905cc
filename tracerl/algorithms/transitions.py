"""Credit assignment: the spans of one finished rollout become training rows.

Calls of one thread (one conversation of one role: Span.thread_id) whose prompt extends an
earlier call's prompt + completion are merged into one row, so a multi-turn conversation is
trained as one sequence in which every token appears once: the sampled completions carry
mask 1 and their behaviour log-probs, the tool/user turns in between carry mask 0. A call
whose prompt does not extend any open row of its thread (a prefix break) starts a new row;
calls of two threads never share one, even when one's prompt happens to extend the other's
tokens. Spans recorded before threads existed (thread_id None) form one thread per role.

Returns: every row gets the rollout's final reward (the trajectory's outcome), unless its
role was given a reward of its own (`role_rewards`), which replaces the outcome for that
role's rows; a per-step reward (keyed by span seq) is added to the return of the row that
holds that span only (undiscounted, not propagated to other rows). With prefix merging a
role's conversation is usually one row, so step rewards then just add to its total return.

A row carries the temperature its log-probs were taken at, `effective_temperature` of its
calls': a greedy call (temperature 0, as evaluators often ask) was recorded at T = 1, so it
merges with T = 1 calls and the trainer divides its logits by 1, never by 0.

A call that returned n > 1 choices records a span per choice (`Span.choice` says which),
and only the choices the agent kept earn the rollout's return: those the conversation went
on from (a later call's prompt extends its prompt + completion), or, when it went on from
none (a final answer), those whose content is the rollout's answer. Of identical choices the
first is trained, once. The others stay in the store and make no row, unless the agent gave
one a step reward of its own: it is then a row whose return is that reward alone.

A span without tokens (a frozen role served by a remote OpenAI-compatible URL records text
only) cannot be trained and makes no row.

With `unassisted`, only the spans whose prompt the gateway also recorded without its assets
(types.UNASSISTED: an asset curriculum that distills) make rows, on that prompt: their
completions, sampled with the asset, are what the policy should say without it (context
distillation; algorithms/rows.py decides their advantages). Their behaviour log-probs were
taken under the other prompt, so they become NaN, unknown: the trainer weights those tokens
as if the proximal policy had sampled them (trainer/loss.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tracerl.types import UNASSISTED, Span, Transition, effective_temperature

__all__ = ["spans_to_transitions"]


@dataclass
class _Row:
    """A row being built; frozen into a Transition at the end."""

    role: str
    temperature: float
    """The temperature its log-probs were taken at (`effective_temperature`)."""
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    span_ids: list[str] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)

    def extends(self, span: Span) -> bool:
        """Whether the span's prompt starts with this row's whole sequence."""
        n = len(self.input_ids)
        return (
            effective_temperature(span.temperature) == self.temperature
            and len(span.prompt_ids) >= n
            and span.prompt_ids[:n] == self.input_ids
        )

    def append(self, span: Span) -> None:
        """Add the new part of the span's prompt (context) and its completion (sampled)."""
        context = span.prompt_ids[len(self.input_ids) :]
        self.input_ids += context + span.completion_ids
        self.loss_mask += [0] * len(context) + [1] * len(span.completion_ids)
        self.logprobs += [0.0] * len(context) + list(span.logprobs)
        self.versions += [-1] * len(context) + [span.policy_version] * len(span.completion_ids)
        self.span_ids.append(span.id)
        self.seqs.append(span.seq)


def _merge_thread(spans: list[Span]) -> list[_Row]:
    """Merge one thread's spans (in seq order) into rows."""
    rows: list[_Row] = []
    for span in spans:
        if len(span.logprobs) != len(span.completion_ids):
            raise ValueError(f"span {span.id}: logprobs and completion_ids differ in length")
        # Latest open row first: the common case is a conversation that keeps growing.
        row = next((r for r in reversed(rows) if r.extends(span)), None)
        if row is None:
            row = _Row(role=span.role, temperature=effective_temperature(span.temperature))
            rows.append(row)
        row.append(span)
    return rows


def _extends(span: Span, ids: list[int]) -> bool:
    """Whether the span's prompt starts with `ids`."""
    return len(span.prompt_ids) >= len(ids) and span.prompt_ids[: len(ids)] == ids


def _content(span: Span) -> str:
    """The text content of the reply the span returned."""
    message = span.response.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    return content.strip() if isinstance(content, str) else ""


def _kept_choices(
    call: str, choices: list[tuple[int, Span]], spans: list[Span], answer: str | None
) -> list[Span]:
    """The choices (index, span) of one call the agent kept: those a later call went on
    from, else those returned as the answer; the first of identical ones."""
    others = [s for s in spans if s.choice is None or s.choice.call != call]
    kept = [
        (i, c)
        for i, c in choices
        if any(_extends(o, c.prompt_ids + c.completion_ids) for o in others)
    ]
    if not kept and answer is not None and answer.strip():
        kept = [(i, c) for i, c in choices if _content(c) == answer.strip()]
    first: dict[tuple[int, ...], Span] = {}
    for _, c in sorted(kept, key=lambda ic: ic[0]):
        first.setdefault(tuple(c.completion_ids), c)
    return list(first.values())


def _left_aside(spans: list[Span], answer: str | None) -> set[str]:
    """Ids of the choices of n > 1 calls the agent did not keep."""
    calls: dict[str, list[tuple[int, Span]]] = {}
    for span in spans:
        if (which := span.choice) is not None:
            calls.setdefault(which.call, []).append((which.index, span))
    out: set[str] = set()
    for call, choices in calls.items():
        kept = {c.id for c in _kept_choices(call, choices, spans, answer)}
        out |= {c.id for _, c in choices if c.id not in kept}
    return out


def _unassisted(span: Span) -> Span:
    """A distilled span as trained: on its prompt without assets (module doc)."""
    ids = span.response.get(UNASSISTED)
    assert isinstance(ids, list)
    plain = [int(i) for i in ids if isinstance(i, int)]
    nan = [math.nan] * len(span.completion_ids)
    return span.model_copy(update={"prompt_ids": plain, "logprobs": nan, "prefix_reused": 0})


def spans_to_transitions(
    spans: list[Span],
    reward: float,
    step_rewards: dict[int, float] | None = None,
    role_rewards: dict[str, float] | None = None,
    *,
    group_id: str,
    task_id: str,
    answer: str | None = None,
    unassisted: bool = False,
) -> list[Transition]:
    """Turn the spans of one rollout attempt into training rows, one or more per role.

    Roles come out in order of first appearance, and a role's rows in order of their
    thread's first call, then of their own; then a row for each choice left aside that has
    a step reward. `step_rewards` maps a span seq to a reward added to its row's return;
    `role_rewards` maps a role to the final reward its rows take instead of `reward`;
    `answer` (the rollout's) tells which choice of a final n > 1 call was returned;
    `unassisted`: the rows of its distilled spans instead (module doc).
    """
    if not spans:
        return []
    rollout_ids = {(s.rollout_id, s.attempt) for s in spans}
    if len(rollout_ids) != 1:
        raise ValueError(f"spans of one rollout attempt expected, got {sorted(rollout_ids)}")
    steps, roles = step_rewards or {}, role_rewards or {}
    aside = _left_aside(spans, answer)
    if unassisted:
        spans = [_unassisted(s) for s in spans if isinstance(s.response.get(UNASSISTED), list)]
        if not spans:
            return []
    by_role: dict[str, dict[str | None, list[Span]]] = {}
    for span in sorted(spans, key=lambda s: s.seq):
        if span.completion_ids and span.id not in aside:
            by_role.setdefault(span.role, {}).setdefault(span.thread_id, []).append(span)
    rid = spans[0].rollout_id
    out = []
    for role, threads in by_role.items():
        final = roles.get(role, reward)
        for thread_spans in threads.values():
            for row in _merge_thread(thread_spans):
                ret = final + sum(steps.get(seq, 0.0) for seq in row.seqs)
                out.append(_freeze(row, rid, group_id, task_id, ret))
    rewarded = [] if unassisted else [
        s for s in spans if s.id in aside and s.seq in steps and s.completion_ids
    ]  # fmt: skip
    for span in sorted(rewarded, key=lambda s: s.seq):  # the agent's own reward, alone
        (row,) = _merge_thread([span])
        out.append(_freeze(row, rid, group_id, task_id, steps[span.seq]))
    return out


def _freeze(row: _Row, rollout_id: str, group_id: str, task_id: str, ret: float) -> Transition:
    return Transition(
        rollout_id=rollout_id,
        group_id=group_id,
        task_id=task_id,
        role=row.role,
        input_ids=row.input_ids,
        loss_mask=row.loss_mask,
        behaviour_logprobs=row.logprobs,
        versions=row.versions,
        advantages=[0.0] * len(row.input_ids),
        reward=ret,
        span_ids=row.span_ids,
        num_spans=len(row.span_ids),
        temperature=row.temperature,
    )
