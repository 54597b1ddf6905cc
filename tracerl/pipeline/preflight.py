"""The pre-flight check: a look at the start before any update, with reasons in words.

Before training, `guard.preflight_tasks` training tasks are each run group_size times
through the gateway (nothing is trained on them). What GRPO needs from a start shows in
those groups: some groups with mixed rewards (a group where every rollout got the same
reward has no advantage to learn from), rollouts that finish with an outcome, prompts that
fit the context. The check also says what the failures look like: a failing rollout that
made as many model calls as the successful ones used its tools and got the content wrong,
which RL from rewards fixes slowly; one that made fewer skipped a tool, a habit RL fixes
fast (docs/recipes.md).

A reward that is 0 on every pre-flight rollout refuses the run (PreflightError) unless
--no-guard.preflight: no update can come of it, and the usual cause is a broken reward or
agent. A reward function that raised for `guard.max_reward_errors` of them stops it too
(RewardFunctionFailed, with the traceback), as it would stop training: such rollouts have
no reward, and the rewards above are those of the others. Everything else, a reward that is
always 1 included, is a warning.
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict

from pydantic import BaseModel, ConfigDict

from tracerl.evaluate import run_rollouts
from tracerl.pipeline.guards import RewardFunctionFailed, failures_with_tools
from tracerl.pipeline.sources import Agents
from tracerl.store import Store
from tracerl.types import HAS_OUTCOME, Rollout, Span, Task

__all__ = ["PreflightError", "PreflightReport", "check_start", "preflight"]

log = logging.getLogger("tracerl.guard")

NEAR_CONTEXT = 0.9
"""A call whose prompt and completion fill this share of the context is near its limit."""


class PreflightError(ValueError):
    """The start cannot improve under RL as configured (the message says why)."""


class PreflightReport(BaseModel):
    """What the pre-flight groups showed (runs/<name>/preflight.json)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    groups: int
    """Groups run (one training task each)."""
    rollouts: int
    """Rollouts run."""
    mean_reward: float
    """Mean final reward (a missing one read as 0)."""
    success: float
    """Share of rollouts at or above the success threshold."""
    mixed_groups: float
    """Share of groups whose rewards differ: the groups GRPO learns from."""
    errors: float
    """Share of rollouts that failed with an error (the agent or reward raised) or ended
    without an outcome (a timeout, expired leases)."""
    near_context: float
    """Share of model calls within 10% of the engine's context or cut at max tokens."""
    failures_with_tools: float | None
    """Among failing rollouts, the share that made at least as many model calls as the
    successful ones do on average (wrong content rather than a skipped tool); None when
    there are no successes or no failures to compare."""
    warnings: list[str]
    """What looks wrong, in words."""


def _errored(r: Rollout) -> bool:
    return r.error is not None or r.status not in HAS_OUTCOME


def _near(span: Span, max_context: int) -> bool:
    used = len(span.prompt_ids) + len(span.completion_ids)
    return span.finish_reason == "length" or used >= NEAR_CONTEXT * max_context


def check_start(
    rollouts: list[Rollout], spans: list[Span], max_context: int, threshold: float
) -> PreflightReport:
    """The report of finished pre-flight rollouts (grouped by task) and their spans; the
    rewards are those of the rollouts whose reward function did not raise."""
    scored = [r for r in rollouts if not r.reward_failed]
    by_task: dict[str, list[float]] = defaultdict(list)
    for r in scored:
        by_task[r.task_id].append(r.reward or 0.0)
    calls: dict[str, int] = defaultdict(int)
    for s in spans:
        calls[s.rollout_id] += 1
    rewards = [r.reward or 0.0 for r in scored]
    won = [x >= threshold for x in rewards]
    n = max(len(rollouts), 1)
    report = PreflightReport(
        groups=len({r.task_id for r in rollouts}),
        rollouts=len(rollouts),
        mean_reward=statistics.fmean(rewards) if rewards else 0.0,
        success=sum(won) / n,
        mixed_groups=sum(len(set(v)) > 1 for v in by_task.values()) / max(len(by_task), 1),
        errors=sum(_errored(r) for r in rollouts) / n,
        near_context=sum(_near(s, max_context) for s in spans) / max(len(spans), 1),
        failures_with_tools=failures_with_tools([calls[r.id] for r in scored], won),
        warnings=[],
    )
    return report.model_copy(update={"warnings": _warnings(report, rewards)})


def _warnings(rep: PreflightReport, rewards: list[float]) -> list[str]:
    out = []
    if rep.errors >= 0.2:
        out.append(
            f"{rep.errors:.0%} of rollouts failed with an error or timed out: "
            "see `tracerl traces list` and `tracerl traces show <id>`"
        )
    if rep.near_context >= 0.1:
        out.append(
            f"{rep.near_context:.0%} of model calls filled the context or hit max_tokens: "
            "the context is too short for this agent (a longer-context model, shorter prompts)"
        )
    if rewards and max(rewards) == min(rewards):
        out.append(f"the reward is {rewards[0]:g} on all {rep.rollouts} rollouts: no variance")
    elif rep.mixed_groups < 0.25:
        out.append(
            f"only {rep.mixed_groups:.0%} of groups have mixed rewards: most steps will carry "
            "little signal (a larger group_size, or a start nearer 20-50% success)"
        )
    if rep.failures_with_tools is not None and rep.failures_with_tools >= 0.6:
        out.append(
            f"{rep.failures_with_tools:.0%} of failing rollouts made as many model calls as the "
            "successful ones: failures look like wrong content, not a skipped tool; RL fixes "
            "content slowly (docs/recipes.md: SFT the skill further first)"
        )
    return out


def preflight(
    store: Store,
    agents: Agents,
    tasks: list[Task],
    group_size: int,
    max_context: int,
    threshold: float,
    refuse: bool = True,
    max_reward_errors: int | None = None,
    assets: dict[str, int] | None = None,
) -> PreflightReport:
    """Run the pre-flight groups (their rollouts given `assets`: as training starts them)
    and report; PreflightError when the reward never varies, RewardFunctionFailed when it
    raised for `max_reward_errors` rollouts."""
    rollouts = run_rollouts(
        store, agents.gateway_url, agents.agent, agents.reward_fn, tasks, group_size,
        agents.cfg, group_id=f"preflight-{tasks[0].id}", desc="pre-flight",
        model=agents.model, threshold=threshold, assets=assets,
    )  # fmt: skip
    failed = [r for r in rollouts if r.reward_failed]
    if max_reward_errors is not None and len(failed) >= max_reward_errors:
        raise RewardFunctionFailed(len(failed), failed[-1].error or "")
    spans = [s for r in rollouts for s in store.spans(r.id)]
    report = check_start(rollouts, spans, max_context, threshold)
    for w in report.warnings:
        log.warning("pre-flight: %s", w)
    rewards = [r.reward or 0.0 for r in rollouts if not r.reward_failed]
    if refuse and rewards and max(rewards) == min(rewards) == 0:
        raise PreflightError(
            f"pre-flight: the reward was 0 on all {len(rewards)} rollouts of "
            f"{report.groups} training tasks, so every advantage is 0 and training cannot "
            "change the model. Check the reward function and the agent's answers "
            "(`tracerl traces list`), or pass --no-guard.preflight to train anyway."
        )
    return report
