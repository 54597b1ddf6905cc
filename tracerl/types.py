"""Records that cross a boundary between tracerl's parts.

Every record here is typed and frozen: a task as the user wrote it, a rollout attempt and
its lifecycle, a span (one model call recorded token by token), a reward, and what an
engine is asked and answers. Token ids and log-probs travel as plain lists here; the store
packs them into compact arrays on disk.
"""

from __future__ import annotations

import math
import time
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

__all__ = [
    "ChoiceOf",
    "FINISHED",
    "HAS_OUTCOME",
    "REWARD_ERROR",
    "REWARD_LIMIT",
    "SEED_LIMIT",
    "UNASSISTED",
    "VALID_TRANSITIONS",
    "FinishedRollout",
    "Generation",
    "Group",
    "PolicyVersion",
    "Reward",
    "RewardValue",
    "Rollout",
    "RolloutStatus",
    "SamplingParams",
    "Span",
    "Task",
    "Transition",
    "bounded_reward",
    "effective_temperature",
]


SEED_LIMIT = 2**62
"""Rollout seeds lie below this, so seed + k (the k-th call's) stays within 64 bits."""


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Task(_Record):
    """One problem for the agent; several rollouts may attempt it."""

    id: str
    """Unique id, chosen by the user or generated when the task is added."""
    input: dict[str, JsonValue]
    """What the agent receives, exactly as written in the task file (e.g. {"question": ...})."""
    answer: JsonValue = None
    """Reference answer the reward function may compare against; never shown to the agent."""
    split: str = "train"
    """Which set the task belongs to ("train", "eval", ...)."""


class RolloutStatus(StrEnum):
    """Where a rollout attempt is in its lifecycle."""

    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    timed_out = "timed_out"

    @property
    def shown(self) -> str:
        """How the state reads to a person, in every report, list and page. The stored names
        stay (they are in every database), but "succeeded" only means the agent returned an
        answer, so it reads "answered": whether the answer was right is the reward."""
        return STATUS_SHOWN[self]


STATUS_SHOWN: dict[RolloutStatus, str] = {
    RolloutStatus.queued: "queued",
    RolloutStatus.running: "running",
    RolloutStatus.succeeded: "answered",
    RolloutStatus.failed: "error",
    RolloutStatus.timed_out: "timed out",
}
"""The one vocabulary statuses are shown in (`RolloutStatus.shown`)."""


FINISHED = frozenset({RolloutStatus.succeeded, RolloutStatus.failed, RolloutStatus.timed_out})
"""Final states: a rollout here never changes again."""
HAS_OUTCOME = frozenset({RolloutStatus.succeeded, RolloutStatus.failed})
"""Final states with an outcome to learn from: the agent answered (rightly or not). A
timed-out rollout, or one whose attempts all expired, has none and is never trained on."""

REWARD_ERROR = "reward function raised"
"""How the error of a rollout whose reward function raised begins (its traceback follows).
That is a bug of the user's reward code, not an outcome of the agent: such a rollout is
finished `failed` without a reward, kept in the store, and never trained on. (An agent's own
error starts with its exception's type name, so the two never read alike.)"""

# The lifecycle as data: the store refuses any transition not listed here.
# running -> queued happens when a runner's lease expires (it died or hung) and the
# rollout still has attempts left; each new claim starts a new attempt.
VALID_TRANSITIONS: dict[RolloutStatus, frozenset[RolloutStatus]] = {
    RolloutStatus.queued: frozenset({RolloutStatus.running, RolloutStatus.failed}),
    RolloutStatus.running: frozenset(
        {
            RolloutStatus.succeeded,
            RolloutStatus.failed,
            RolloutStatus.timed_out,
            RolloutStatus.queued,
        }
    ),
    RolloutStatus.succeeded: frozenset(),
    RolloutStatus.failed: frozenset(),
    RolloutStatus.timed_out: frozenset(),
}


class Rollout(_Record):
    """One attempt of one task by the agent, as the store sees it."""

    id: str
    """Unique id; also the path segment in the gateway URL (/rollouts/<id>/v1)."""
    task_id: str
    """The task this rollout attempts."""
    status: RolloutStatus = RolloutStatus.queued
    """Lifecycle state; changes only along VALID_TRANSITIONS."""
    attempt: int = 0
    """How many times a runner has claimed it; spans and rewards belong to one attempt."""
    max_attempts: int = 3
    """After this many expired leases the rollout fails instead of being re-queued."""
    group_id: str | None = None
    """Rollouts sharing a group share a baseline (the same task within one step)."""
    runner_id: str | None = None
    """Who holds the lease now (None while queued or finished)."""
    lease_expires_at: float | None = None
    """Unix time after which the store re-queues a running rollout whose runner went silent."""
    created_at: float = Field(default_factory=time.time)
    """When it was queued."""
    started_at: float | None = None
    """When the current attempt was claimed."""
    finished_at: float | None = None
    """When it reached a final state."""
    answer: str | None = None
    """The agent's final answer, as the runner received it."""
    reward: float | None = None
    """The final reward of the last attempt (also stored as a Reward record)."""
    error: str | None = None
    """Why it failed or timed out: an exception's text, 'lease expired', ..."""
    assets: dict[str, Annotated[int, Field(ge=0, lt=2**31)]] | None = None
    """The asset versions its model calls see, name -> version (0: that asset withheld),
    over the gateway's own config for the names given (a paired comparison's arms, a
    curriculum's draws); None: the gateway's config alone decides. Fixed at enqueue."""
    seed: int | None = Field(default=None, ge=0, lt=SEED_LIMIT)
    """Sampling seed of its calls that bring none: the k-th call of an attempt samples with
    seed + k, so two rollouts given one seed draw the same random numbers (the two arms of
    a paired comparison); None: the engine's own generator. Fixed at enqueue."""

    @property
    def reward_failed(self) -> bool:
        """Whether its reward function raised (see REWARD_ERROR)."""
        return self.error is not None and self.error.startswith(REWARD_ERROR)

    @property
    def has_outcome(self) -> bool:
        """Whether it has an outcome to learn from: a state in HAS_OUTCOME, and a reward
        function that did not raise."""
        return self.status in HAS_OUTCOME and not self.reward_failed


class ChoiceOf(_Record):
    """Which of a call's n > 1 sampled choices a span holds (kept in span.response["choice"];
    a call of one choice has none)."""

    call: str
    """The span id of the call's first choice: the same for all its choices."""
    index: int = Field(ge=0)
    """The choice's position among the call's choices."""
    of: int = Field(ge=2)
    """How many choices the call returned."""


class Span(_Record):
    """One model call inside a rollout, recorded token by token by the gateway.

    The prompt/completion split is decided here, at capture time, and carried to the loss:
    completion_ids are exactly the tokens the policy sampled, and nothing downstream
    re-tokenizes text to find them again.
    """

    id: str
    """Unique id."""
    rollout_id: str
    """The rollout this call belongs to."""
    attempt: int = Field(ge=0, lt=2**31)
    """The rollout attempt during which the call was made."""
    seq: int = Field(ge=0, lt=2**31)
    """Order of the call within the attempt, from 0."""
    role: str
    """The `model` name the agent asked for: which policy or frozen model answered."""
    policy_version: int = Field(ge=-1, lt=2**31)
    """Version of the weights that sampled the completion (-1: a remote role's text)."""
    prompt_ids: list[int]
    """Exact token ids the engine was given."""
    completion_ids: list[int]
    """Exact token ids the engine sampled (including the end token if it was sampled)."""
    logprobs: list[float]
    """Log-probability of each completion token under the behaviour policy, at the sampling
    temperature, before any top-p truncation; len(logprobs) == len(completion_ids)."""
    messages: list[dict[str, JsonValue]] = Field(default_factory=list)
    """The chat messages of the request (OpenAI format), for reading traces; [] for
    plain completions."""
    response: dict[str, JsonValue] = Field(default_factory=dict)
    """The message returned to the agent (content, tool_calls) and the finish reason."""
    finish_reason: str = "stop"
    """'stop' (end token or stop string), 'length' (max_tokens) or 'tool_calls'."""
    temperature: float = 1.0
    """Sampling temperature asked for (0: greedy). The log-probs were taken at
    `effective_temperature` of it: 1 for a greedy call."""
    prefix_reused: int = Field(default=0, ge=0, lt=2**31)
    """How many leading prompt ids were taken verbatim from the previous call of this
    rollout and role (token-in/token-out); 0 for a first call or after a prefix break."""
    prefix_break: str | None = None
    """Why the previous call's ids could not be reused (edited history, template drift...),
    or None when they were reused or there was nothing to reuse."""
    parent_span_id: str | None = None
    """The span of the agent that spawned this call's agent, when agents nest."""
    latency_s: float = 0.0
    """Wall time from request to response inside the gateway."""
    created_at: float = Field(default_factory=time.time)
    """When the call finished."""
    thread_id: str | None = None
    """The conversation (thread) of the rollout this call belongs to: the id of the thread's
    first span. A call that extends an earlier call's conversation joins its thread; a new
    conversation starts one. Each thread is its own trajectory for training. None for raw
    completions and for spans recorded before threads existed."""
    parent_thread_id: str | None = None
    """The thread this call's thread branched from (a sub-agent, a compaction, a call naming
    its parent); None for a thread that starts afresh. Set on every span of the thread."""
    assets: dict[str, int] = Field(default_factory=dict)
    """The assets in its prompt, name -> version (tracerl.assets): what the gateway added to
    the system message before templating; {} when none was."""

    @property
    def choice(self) -> ChoiceOf | None:
        """Which of its call's n > 1 choices this span holds; None for a call of one."""
        raw = self.response.get("choice")
        return ChoiceOf.model_validate(raw) if raw is not None else None


class Reward(_Record):
    """A scalar reward for a rollout, final or for one step."""

    rollout_id: str
    """The rollout it rewards."""
    attempt: int = Field(ge=0, lt=2**31)
    """The attempt it rewards; rewards of abandoned attempts are ignored."""
    value: float
    """The reward."""
    span_seq: int | None = Field(default=None, ge=0, lt=2**31)
    """For a per-step reward, the seq of the span it rewards; None for the final reward."""
    role: str | None = None
    """For a per-role final reward, the role it credits: that role's rows take it instead
    of the trajectory's outcome. None credits the whole trajectory (every role)."""
    name: str = "reward"
    """A label for reports (e.g. 'correct', 'format')."""
    created_at: float = Field(default_factory=time.time)
    """When it was given."""


REWARD_LIMIT = 1e6
"""The largest reward magnitude the HTTP APIs accept (the gateway's POST
/rollouts/<id>/reward, the store's /finish and /rewards): a reward beyond it, or one that is
not finite, is refused there (400 / 422), never stored. Rewards in [-1e6, 1e6] keep every
group statistic finite; a larger one is a bug (a sentinel, an overflow), not a signal."""

RewardValue = Annotated[float, Field(ge=-REWARD_LIMIT, le=REWARD_LIMIT, allow_inf_nan=False)]
"""A reward as an API request may carry it: finite and within REWARD_LIMIT."""


def bounded_reward(value: float | None) -> float:
    """A stored reward as the training side reads it: a missing or NaN one as 0, and one
    beyond REWARD_LIMIT (only an in-process reward function can give one) as the limit,
    with its sign, so that advantages stay finite whatever was recorded."""
    if value is None or math.isnan(value):
        return 0.0
    return max(-REWARD_LIMIT, min(REWARD_LIMIT, value))


ENGINE_OUTAGE = "engine_outage"
"""Name of the Reward record the gateway gives an attempt one of whose model calls found no
engine replica in service (a 503 `engine_unavailable`). What the agent made of the outage
says nothing of the policy, so the runner re-runs such an attempt instead of finishing it."""


UNASSISTED = "unassisted_prompt_ids"
"""Key of a span's response holding the prompt's ids without its assets, which the gateway
records for the assets it is told to (GatewayConfig.unassisted: an asset curriculum's, when
it distills). Such a span also makes a row on that prompt, its completion taught there
(algorithms/rows.py `distilled`, transitions.py)."""


class FinishedRollout(_Record):
    """A finished rollout as the training side sees it, read from the store once: the
    record, and the spans and rewards of its last attempt (none for a rollout without an
    outcome, whose spans are never trained on)."""

    rollout: Rollout
    """The store's record (status, attempt, final reward, answer)."""
    spans: list[Span] = Field(default_factory=list)
    """The model calls of its last attempt, in call order."""
    rewards: list[Reward] = Field(default_factory=list)
    """The rewards given to its last attempt (final, per role and per step)."""

    @property
    def id(self) -> str:
        """The rollout's id."""
        return self.rollout.id

    @property
    def reward(self) -> float:
        """The final reward as the training side reads it (`bounded_reward`: a missing one
        as 0, one beyond REWARD_LIMIT as the limit)."""
        return bounded_reward(self.rollout.reward)

    @property
    def has_outcome(self) -> bool:
        """Whether it has an outcome to learn from (see Rollout.has_outcome)."""
        return self.rollout.has_outcome

    def success(self, threshold: float) -> bool:
        """Whether it has an outcome and its final reward is at least `threshold`."""
        return self.has_outcome and self.reward >= threshold


class Group(_Record):
    """The finished rollouts of one task that share a baseline."""

    id: str
    """Deterministic id (a function of the run and the task's position in the stream)."""
    task: Task
    """The task every rollout of the group attempted."""
    rollouts: list[FinishedRollout]
    """Its rollouts, in issue order (a replayed one may come from another group)."""

    def with_outcome(self) -> list[FinishedRollout]:
        """The rollouts with an outcome, in order."""
        return [f for f in self.rollouts if f.has_outcome]


class PolicyVersion(_Record):
    """A published version of a trainable policy's weights."""

    version: int = Field(ge=0, lt=2**31)
    """Monotonic version number; 0 is the initial model."""
    path: str = ""
    """The checkpoint's model dir holding these weights, recorded only once that
    checkpoint is written; "" for a step that was not checkpointed. Older checkpoints are
    pruned (pipeline.keep_checkpoints), so only the newest paths stay on disk."""
    role: str = "policy"
    """Which policy this is a version of."""
    created_at: float = Field(default_factory=time.time)
    """When it was published."""


def effective_temperature(temperature: float) -> float:
    """The temperature a completion's log-probs are taken at: the sampling one, or 1 for a
    greedy request (T = 0), whose tokens were picked by argmax. The one definition: engines
    record log-probs at it (tracerl.engines.scoring) and rows carry it to the trainer
    (tracerl.algorithms.transitions), so neither side ever divides logits by 0."""
    return temperature if temperature > 0 else 1.0


class SamplingParams(_Record):
    """How an engine should sample one completion."""

    max_tokens: int = 256
    """Upper bound on sampled tokens."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (log-probs then taken at temperature 1)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables it."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings: generation ends when the decoded completion contains one."""
    seed: int | None = None
    """Seed for this request's sampler; None draws from the engine's generator."""
    top_logprobs: int = Field(default=0, ge=0)
    """How many of the most likely tokens to return at each sampled position (with their
    log-probs, from the distribution `logprobs` are taken from); 0: none."""


class Generation(_Record):
    """What an engine answers for one prompt."""

    completion_ids: list[int]
    """Sampled token ids, including the end token when one was sampled."""
    logprobs: list[float]
    """Log-probability of each sampled token (see Span.logprobs)."""
    finish_reason: str
    """'stop' for an end token or stop string, 'length' for max_tokens."""
    policy_version: int
    """Version of the weights that produced every token of this completion."""
    stop_string: str | None = None
    """The stop string that ended generation, if any."""
    top_logprobs: list[list[tuple[int, float]]] = Field(default_factory=list)
    """With SamplingParams.top_logprobs = k: for each sampled token, the k most likely
    (token id, log-prob) at its position, best first (fewer where a grammar allows fewer);
    empty otherwise, or from an engine that cannot tell."""


class Transition(_Record):
    """One training row: a token sequence of one role of one rollout, with its loss mask.

    Built from spans by `tracerl.algorithms.transitions.spans_to_transitions`: consecutive
    calls whose prompt extends the previous prompt + completion share one row, so every
    token appears once. All per-token lists are aligned with `input_ids`.
    """

    rollout_id: str
    """The rollout the row comes from."""
    group_id: str
    """The group whose rollouts share a baseline."""
    task_id: str
    """The task the rollout attempted."""
    role: str
    """The policy that sampled the row's completions."""
    input_ids: list[int]
    """The whole sequence: prompts, tool/user turns and sampled completions, in order."""
    loss_mask: list[int]
    """1 exactly on tokens the policy sampled, 0 on prompt, tool and user context."""
    behaviour_logprobs: list[float]
    """Log-prob of each sampled token under the policy that sampled it; 0.0 where the
    mask is 0; NaN where unknown (trained under another prompt than it was sampled with:
    the trainer weights it as sampled by the proximal policy)."""
    versions: list[int]
    """Policy version that sampled each token; -1 where the mask is 0."""
    advantages: list[float]
    """Per-token advantage written by the algorithm; 0.0 where the mask is 0."""
    reward: float
    """The return credited to this row: the final reward plus the row's step rewards."""
    span_ids: list[str]
    """The spans merged into this row, in call order."""
    num_spans: int
    """len(span_ids): how many model calls the row holds."""
    weight: float = 1.0
    """Loss weight of each sampled token of this row; the algorithm's per-rollout
    normalisation writes it (see tracerl.algorithms.advantages)."""
    temperature: float = Field(default=1.0, gt=0)
    """The temperature the row's behaviour log-probs were taken at (`effective_temperature`
    of its spans': 1 for greedy ones); the trainer takes log-probs at it so the importance
    ratio compares like with like."""

    @model_validator(mode="after")
    def _aligned(self) -> Transition:
        n = len(self.input_ids)
        lens = (len(self.loss_mask), len(self.behaviour_logprobs), len(self.versions))
        if any(k != n for k in (*lens, len(self.advantages))):
            raise ValueError(f"per-token lists must all have len(input_ids)={n}")
        if self.num_spans != len(self.span_ids):
            raise ValueError("num_spans must equal len(span_ids)")
        return self
