"""Proposers: who writes candidate revisions of an asset, from contrasting traces.

Both are shown the same evidence (`Evidence`): attempts that failed, each beside an attempt
of the same task that succeeded (under another version or another repeat), or of a similar
task when none did; and successful attempts to learn from.

- `LlmProposer` asks a model at any OpenAI-compatible URL (by default the policy the
  gateway serves) to rewrite the text given the contrast; one call per candidate. Its calls
  are recorded in the store as spans of a rollout of their own: through the gateway when it
  calls the served policy (token by token, the asset withheld), as text spans otherwise.
- `BootstrapProposer` calls no model: each candidate is the text plus worked examples drawn
  from successful traces of the failing tasks or their nearest neighbours (as DSPy's
  BootstrapFewShot does); its note names the rollouts they came from.
"""

from __future__ import annotations

import difflib
import random
import re
import time
import uuid
from collections.abc import Sequence
from typing import Protocol

import httpx
import orjson
from pydantic import BaseModel, ConfigDict, JsonValue

from tracerl.store import Store
from tracerl.types import Rollout, RolloutStatus, Span, Task

__all__ = [
    "BootstrapProposer",
    "Case",
    "Evidence",
    "Example",
    "LlmProposer",
    "Proposal",
    "Proposer",
    "transcript",
]

TURN_CHARS = 600
"""Longest message kept in a transcript (the rest elided): the proposer's prompt must fit."""
TRANSCRIPT_CHARS = 2_400
"""Longest transcript kept."""


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Example(_Record):
    """One attempt of a task, as a proposer reads it."""

    task_id: str
    """The task."""
    input: dict[str, JsonValue]
    """What the agent received."""
    rollout_id: str
    """The rollout, for its full trace."""
    version: int
    """The asset version it ran with."""
    success: bool
    """Whether it succeeded."""
    reward: float
    """Its final reward."""
    transcript: str
    """Its conversation after the system message, as text ("user: ...", ...)."""


class Case(_Record):
    """A failure and, beside it, a success to contrast it with."""

    failed: Example
    """An attempt that failed."""
    succeeded: Example | None
    """An attempt of the same task that succeeded, else one of the most similar task that
    did; None when nothing succeeded."""

    @property
    def same_task(self) -> bool:
        """Whether the success is of the failed task itself."""
        return self.succeeded is not None and self.succeeded.task_id == self.failed.task_id


class Evidence(_Record):
    """What a proposer is shown."""

    name: str
    """The asset."""
    text: str
    """The version being revised."""
    cases: list[Case]
    """Failures beside successes."""
    successes: list[Example]
    """Successful attempts, the failed tasks' first (worked examples)."""

    def trimmed(self) -> Evidence | None:
        """Less of it, for a model whose context it overflows: half the cases; one case
        left, transcripts half as long (down to 100 characters); then the case without its
        success; then no case at all (the text alone). None when nothing is left to cut."""
        if len(self.cases) > 1:
            return self.model_copy(update={"cases": self.cases[: len(self.cases) // 2]})
        if not self.cases:
            return None
        case = self.cases[0]
        if len(case.failed.transcript) > 100:
            halved = Case(failed=_halved(case.failed),
                          succeeded=_halved(case.succeeded) if case.succeeded else None)  # fmt: skip
            return self.model_copy(update={"cases": [halved]})
        if case.succeeded is not None:
            return self.model_copy(update={"cases": [Case(failed=case.failed, succeeded=None)]})
        return self.model_copy(update={"cases": []})


def _halved(e: Example) -> Example:
    return e.model_copy(update={"transcript": "..." + e.transcript[-(len(e.transcript) // 2) :]})


class Proposal(_Record):
    """A candidate text and where it came from."""

    text: str
    """The candidate."""
    note: str
    """How it was made (kept as the candidate version's note)."""
    proposer: str
    """"llm:<model>" or "bootstrap"."""
    rollout_id: str | None = None
    """The rollout holding the proposer's calls (None: it made none)."""


class Proposer(Protocol):
    """Writes up to n candidate revisions of `evidence.text`."""

    name: str
    """"llm:<model>" or "bootstrap"."""
    shown: str
    """What it was last shown (the LLM proposer's user message; "" for bootstrap)."""

    def propose(self, evidence: Evidence, n: int, label: str) -> list[Proposal]:
        """The candidates (`label` names the round in what is recorded)."""
        ...


# -- transcripts ------------------------------------------------------------------------


def transcript(spans: Sequence[Span], answer: str | None) -> str:
    """An attempt as text: its last call's conversation after the system message, the
    reply, then the final answer; long messages elided, the whole capped."""
    lines: list[str] = []
    if spans:
        last = spans[-1]
        for msg in last.messages:
            if msg.get("role") in ("system", "developer"):
                continue
            lines.append(_line(msg))
        reply = last.response.get("message")
        if isinstance(reply, dict):
            lines.append(_line(reply))
    lines.append(f"final answer: {answer!r}")
    text = "\n".join(lines)
    return text if len(text) <= TRANSCRIPT_CHARS else "..." + text[-TRANSCRIPT_CHARS:]


def _line(msg: dict[str, JsonValue]) -> str:
    content = str(msg.get("content") or "")
    calls = msg.get("tool_calls") or []
    if isinstance(calls, list) and calls:
        named = [str(c.get("function")) for c in calls if isinstance(c, dict)]
        content += f" [tool calls: {'; '.join(named)}]"
    if len(content) > TURN_CHARS:
        content = content[:TURN_CHARS] + " ..."
    return f"{msg.get('role', '?')}: {content}"


def similar(task: Task, others: Sequence[Task]) -> list[Task]:
    """`others` most similar first (by the text of their inputs)."""
    mine = orjson.dumps(task.input, option=orjson.OPT_SORT_KEYS).decode()

    def score(t: Task) -> float:
        text = orjson.dumps(t.input, option=orjson.OPT_SORT_KEYS).decode()
        return difflib.SequenceMatcher(None, mine, text).ratio()

    return sorted(others, key=score, reverse=True)


# -- the bootstrap proposer -------------------------------------------------------------


class BootstrapProposer:
    """Candidates that add worked examples from successful traces (no model calls)."""

    name = "bootstrap"
    shown = ""

    def __init__(self, examples: int = 3, seed: int = 0) -> None:
        self.examples, self.seed = examples, seed

    def propose(self, evidence: Evidence, n: int, label: str) -> list[Proposal]:
        """n candidates, each the text plus `examples` successes: the first from the front
        of the list (the failed tasks' own or nearest), the rest drawn at random."""
        pool = list({e.rollout_id: e for e in evidence.successes}.values())
        if not pool:
            return []
        rng = random.Random(f"{self.seed}/{label}")
        out: list[Proposal] = []
        for i in range(n):
            head = pool[i % len(pool) : i % len(pool) + 1]
            rest = [e for e in pool if e not in head]
            picked = head + rng.sample(rest, min(self.examples - 1, len(rest)))
            text = evidence.text + "\n\nWorked examples of successful answers:\n\n"
            text += "\n\n".join(_worked(k + 1, e) for k, e in enumerate(picked))
            note = "bootstrap: examples from rollouts " + ", ".join(e.rollout_id for e in picked)
            out.append(Proposal(text=text, note=note, proposer=self.name))
        return _distinct(out)


def _worked(k: int, e: Example) -> str:
    return f"Example {k}:\n{e.transcript}"


def _distinct(proposals: list[Proposal]) -> list[Proposal]:
    seen: set[str] = set()
    out = []
    for p in proposals:
        if p.text not in seen:
            seen.add(p.text)
            out.append(p)
    return out


# -- the LLM proposer -------------------------------------------------------------------

SYSTEM = (
    "You improve the instructions an AI agent is given in its system message. You see the "
    "current instructions, and tasks where the agent failed beside attempts that "
    "succeeded. Write improved instructions that would make the failed attempts succeed "
    "without breaking the successful ones: general rules, not answers to these tasks. "
    "Reply with the complete new instructions between <prompt> and </prompt>, nothing else."
)
"""The proposer's own system message."""

_PROMPT = re.compile(r"<prompt>(.*?)(?:</prompt>|$)", re.DOTALL)


def proposer_prompt(evidence: Evidence) -> str:
    """The user message an LLM proposer is sent: the text and each failure beside its
    success."""
    parts = [f"Current instructions:\n<prompt>\n{evidence.text}\n</prompt>"]
    for i, case in enumerate(evidence.cases, start=1):
        f = case.failed
        parts.append(
            f"## Task {i}\nInput: {orjson.dumps(f.input).decode()}\n"
            f"### Failed attempt (reward {f.reward:g})\n{f.transcript}"
        )
        if case.succeeded is not None:
            whose = "the same task" if case.same_task else "a similar task"
            s = case.succeeded
            parts.append(f"### Successful attempt ({whose}, reward {s.reward:g})\n{s.transcript}")
    parts.append("Write the improved instructions.")
    return "\n\n".join(parts)


def parse_candidate(reply: str) -> str:
    """The text between <prompt> and </prompt> (to the end when unclosed), else the whole
    reply, stripped."""
    found = _PROMPT.search(reply)
    return (found.group(1) if found else reply).strip()


class LlmProposer:
    """Candidates written by a model at an OpenAI-compatible URL, one call each, recorded
    in the store as spans of a rollout of their own."""

    def __init__(
        self,
        store: Store,
        base_url: str,
        model: str,
        api_key: str = "tracerl",
        temperature: float = 1.0,
        max_tokens: int = 512,
        served: bool = False,
        withhold: dict[str, int] | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        """`served`: `base_url` is this store's gateway (root URL), which records the calls
        itself under the proposer's rollout; else they are recorded here as text.
        `withhold` is the proposer rollout's assets ({name: 0}: none in its prompts)."""
        self.store, self.base_url, self.model = store, base_url.rstrip("/"), model
        self.api_key, self.temperature, self.max_tokens = api_key, temperature, max_tokens
        self.served, self.withhold, self.timeout_s = served, withhold or {}, timeout_s
        self.name = f"llm:{model}"
        self.shown = ""

    def propose(self, evidence: Evidence, n: int, label: str) -> list[Proposal]:
        """n calls with distinct seeds; replies without text are skipped. Evidence that
        overflows the model's context is cut (Evidence.trimmed) until it fits."""
        rollout = _open_rollout(self.store, label, self.withhold)
        url = f"{self.base_url}/rollouts/{rollout.id}/v1" if self.served else self.base_url
        out: list[Proposal] = []
        answered = RolloutStatus.failed
        try:
            with httpx.Client(timeout=self.timeout_s) as http:
                for i in range(n):
                    # Each call may take a while on a CPU: the lease covers the next one.
                    self.store.heartbeat(rollout.id, rollout.attempt, self.timeout_s + 60)
                    reply, evidence = self._fitted(http, url, evidence, i, rollout)
                    text = parse_candidate(reply)
                    if text:
                        note = f"{self.name}: candidate {i + 1} of {label}"
                        out.append(Proposal(text=text, note=note, proposer=self.name,
                                            rollout_id=rollout.id))  # fmt: skip
            answered = RolloutStatus.succeeded
        finally:
            self.store.finish(
                rollout.id, rollout.attempt, answered, answer=f"{len(out)} candidates"
            )
        return _distinct(out)

    def _fitted(
        self, http: httpx.Client, url: str, evidence: Evidence, i: int, rollout: Rollout
    ) -> tuple[str, Evidence]:
        """The reply to the evidence, cut until the model's context holds it; and what was
        shown."""
        while True:
            self.shown = proposer_prompt(evidence)
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": self.shown}]  # fmt: skip
            try:
                return self._call(http, url, messages, i, rollout), evidence
            except _TooLong:
                smaller = evidence.trimmed()
                if smaller is None:
                    raise RuntimeError(
                        f"proposer {self.name}: the text alone overflows its context"
                    ) from None
                evidence = smaller

    def _call(
        self, http: httpx.Client, url: str, messages: list[dict], i: int, rollout: Rollout
    ) -> str:
        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "seed": i}  # fmt: skip
        started = time.perf_counter()
        resp = http.post(
            f"{url}/chat/completions", json=body,
            headers={"authorization": f"Bearer {self.api_key}"},
        )  # fmt: skip
        if resp.status_code == 400 and _overflows(resp):
            raise _TooLong
        if resp.status_code >= 400:
            raise RuntimeError(
                f"proposer {self.name} at {url}: HTTP {resp.status_code}: {resp.text[:500]}"
            )
        choice = resp.json()["choices"][0]
        if not self.served:
            self._record(rollout, messages, choice, time.perf_counter() - started)
        return str(choice["message"].get("content") or "")

    def _record(self, rollout: Rollout, messages: list[dict], choice: dict, latency: float) -> None:
        """A text span of the call (no token ids: another server sampled it)."""
        finish = str(choice.get("finish_reason") or "stop")
        span = Span(
            id=uuid.uuid4().hex, rollout_id=rollout.id, attempt=rollout.attempt, seq=0,
            role=self.name, policy_version=-1, prompt_ids=[], completion_ids=[], logprobs=[],
            messages=messages, response={"message": choice["message"], "finish_reason": finish},
            finish_reason=finish, temperature=self.temperature, latency_s=latency,
        )  # fmt: skip
        self.store.append_spans([span])


class _TooLong(Exception):
    """The proposer's prompt did not fit its model's context."""


def _overflows(resp: httpx.Response) -> bool:
    """Whether a 400 says the prompt is longer than the model's context (tracerl's and
    OpenAI's code, or the usual wording of other servers)."""
    text = resp.text.lower()
    return "context_length_exceeded" in text or "maximum context length" in text


PROPOSER_SPLIT = "proposer"
"""The split of the proposer rollouts' tasks: training and evaluation never take them."""


def _open_rollout(store: Store, label: str, withhold: dict[str, int]) -> Rollout:
    """A running rollout to record one round's proposer calls under, claimed here (the
    optimizer's store is its own while it proposes: a rollout someone else queued meanwhile
    would be claimed instead, and is then left to its short lease)."""
    task = Task(id=f"proposer/{label}", input={"proposer": label}, split=PROPOSER_SPLIT)
    store.add_tasks([task])
    (queued,) = store.enqueue([task.id], group_id=f"proposer/{label}", max_attempts=1,
                              assets=withhold or None)  # fmt: skip
    claimed = store.claim("assets-proposer", 1, lease_s=30.0)
    if [r.id for r in claimed] != [queued.id]:
        store.finish(queued.id, 0, RolloutStatus.failed, error="not claimed")
        raise RuntimeError(
            "another process's rollout was queued in this store while proposing; run "
            "`tracerl assets optimize` on a store no runner is serving"
        )
    return claimed[0]
