"""Run N rollouts of an agent through the gateway and report success and trace statistics.

Evaluation is the same machinery as training without the update: tasks go into the store,
rollouts are queued, a runner pool plays them through the gateway, and the recorded spans
say how the agent used the model (calls per rollout, tokens, token reuse, latency).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from statistics import mean

from pydantic import BaseModel, ValidationError
from rich.console import Console
from tqdm import tqdm

from tracerl.agents import AgentFn, RewardFn
from tracerl.jsonl import read_objects
from tracerl.runner import Runner, RunnerConfig
from tracerl.store import Store
from tracerl.types import Rollout, Span, Task


def load_tasks(path: str | Path, split: str | None = None) -> list[Task]:
    """Tasks from JSONL: one {"id"?, "input", "answer"?, "split"?} object per line.

    A line may also be a bare input object (no "input" key); ids default to the line number.
    """
    tasks = []
    for n, raw in read_objects(path):
        if "input" not in raw:
            raw = {"input": raw}
        raw.setdefault("id", f"{Path(path).stem}-{n}")
        try:
            task = Task.model_validate(raw)
        except ValidationError as e:
            raise ValueError(f"{path}:{n}: {e.errors()[0]['msg']}") from None
        if split is None or task.split == split:
            tasks.append(task)
    if not tasks:
        raise ValueError(f"{path}: no tasks" + (f" in split {split!r}" if split else ""))
    return tasks


class RoleStats(BaseModel):
    """How one role (a `model` name) was used over the evaluation's rollouts."""

    calls_per_rollout: float
    """Its model calls per rollout."""
    agents_per_rollout: float
    """Its agents per rollout: distinct parent spans its calls hang under (sub-agents spawned
    per rollout; 1 for a top-level role)."""
    completion_tokens_per_call: float
    """Sampled tokens per call (0 for a remote role, recorded as text)."""


def role_stats(spans: list[Span], rollouts: int) -> dict[str, RoleStats]:
    """Per-role use, roles in order of first call."""
    out: dict[str, RoleStats] = {}
    for role in dict.fromkeys(s.role for s in spans):
        mine = [s for s in spans if s.role == role]
        agents = {(s.rollout_id, s.parent_span_id) for s in mine}
        out[role] = RoleStats(
            calls_per_rollout=len(mine) / max(rollouts, 1),
            agents_per_rollout=len(agents) / max(rollouts, 1),
            completion_tokens_per_call=sum(len(s.completion_ids) for s in mine) / len(mine),
        )
    return out


class EvalReport(BaseModel):
    """What one evaluation measured."""

    rollouts: int
    """Rollouts run."""
    success_rate: float
    """Fraction with reward >= the success threshold."""
    mean_reward: float
    """Mean reward (missing rewards count as 0)."""
    statuses: dict[str, int]
    """Final states and their counts."""
    mean_calls: float
    """Model calls per rollout."""
    mean_prompt_tokens: float
    """Prompt tokens per call."""
    mean_completion_tokens: float
    """Sampled tokens per call."""
    reused_fraction: float
    """Share of prompt tokens taken verbatim from the previous call (token-in/token-out)."""
    prefix_breaks: int
    """Calls that carried on a conversation (thread) whose earlier ids could not be reused;
    a call starting a new conversation is none."""
    mean_latency_s: float
    """Gateway-side latency per call."""
    completion_tokens_per_s: float
    """Sampled tokens per second of wall time."""
    wall_s: float
    """Wall time of the evaluation."""
    group_id: str
    """Group id of these rollouts in the store."""
    roles: dict[str, RoleStats] = {}
    """Per-role use of the model, for agents with several roles."""
    pass_se: float | None = None
    """Sampling noise of the success rate of one pass over these tasks: its standard error
    over draws of the model's samples, the tasks held fixed (estimated from the repeats of
    each task; None with one rollout per task). Two evaluations of the same weights differ by
    about 1.4x this, and the best of k evaluations reads high by about this times the
    expected maximum of k standard normals."""


def run_rollouts(
    store: Store,
    gateway_url: str,
    agent: AgentFn,
    reward_fn: RewardFn | None,
    tasks: list[Task],
    repeats: int = 1,
    cfg: RunnerConfig | None = None,
    group_id: str | None = None,
    desc: str = "rollouts",
    model: str = "policy",
    threshold: float = 1.0,
    assets: dict[str, int] | None = None,
    seeds: list[int] | None = None,
) -> list[Rollout]:
    """Queue repeats x tasks rollouts, run them with a runner pool, return them finished;
    the agent is told to call `model` (the top role); the bar counts rewards >= threshold
    as successes. Every rollout is given `assets` (Rollout.assets: the versions its calls
    see, 0 withholding one) and its entry of `seeds`, in queue order (each task's repeats
    in turn)."""
    store.add_tasks(tasks)
    group_id = group_id or uuid.uuid4().hex[:12]
    ids = [t.id for t in tasks for _ in range(repeats)]
    queued = store.enqueue(ids, group_id=group_id, assets=assets, seeds=seeds)
    bar = tqdm(total=len(queued), desc=desc, unit="rollout", dynamic_ncols=True)
    wins = 0

    def tick(rollout: Rollout) -> None:
        nonlocal wins
        if rollout.group_id != group_id:
            return  # another caller's rollout this pool happened to run
        wins += int((rollout.reward or 0) >= threshold)
        bar.update(1)
        bar.set_postfix(success=f"{wins / max(bar.n, 1):.2f}")

    runner = Runner(store, gateway_url, agent, reward_fn, cfg, on_finish=tick, model=model)
    try:
        asyncio.run(runner.run(until_idle=True))
    finally:
        bar.close()
    return store.rollouts(group_id=group_id)


def report(
    store: Store, rollouts: list[Rollout], wall_s: float, threshold: float = 1.0
) -> EvalReport:
    """Summarise finished rollouts and their spans."""
    spans = [s for r in rollouts for s in store.spans(r.id)]
    statuses: dict[str, int] = {}
    for r in rollouts:
        statuses[r.status.shown] = statuses.get(r.status.shown, 0) + 1
    rewards = [r.reward or 0.0 for r in rollouts]
    prompt = sum(len(s.prompt_ids) for s in spans)
    completion = sum(len(s.completion_ids) for s in spans)
    return EvalReport(
        rollouts=len(rollouts),
        success_rate=sum(x >= threshold for x in rewards) / max(len(rollouts), 1),
        mean_reward=mean(rewards) if rewards else 0.0,
        statuses=statuses,
        mean_calls=len(spans) / max(len(rollouts), 1),
        mean_prompt_tokens=prompt / max(len(spans), 1),
        mean_completion_tokens=completion / max(len(spans), 1),
        reused_fraction=sum(s.prefix_reused for s in spans) / max(prompt, 1),
        prefix_breaks=sum(s.prefix_break is not None for s in spans),
        mean_latency_s=mean(s.latency_s for s in spans) if spans else 0.0,
        completion_tokens_per_s=completion / max(wall_s, 1e-9),
        wall_s=wall_s,
        group_id=rollouts[0].group_id or "" if rollouts else "",
        roles=role_stats(spans, len(rollouts)),
        pass_se=pass_standard_error(rollouts, threshold),
    )


def pass_standard_error(rollouts: list[Rollout], threshold: float = 1.0) -> float | None:
    """The standard error of one pass's success rate, from tasks run more than once:
    sqrt(sum_i p_i (1 - p_i)) / n, with each task's p_i (1 - p_i) estimated without bias
    from its k successes in r repeats, k (r - k) / (r (r - 1))."""
    wins: dict[str, list[bool]] = {}
    for r in rollouts:
        wins.setdefault(r.task_id, []).append((r.reward or 0.0) >= threshold)
    repeated = [w for w in wins.values() if len(w) > 1]
    if not repeated:
        return None
    var = sum(sum(w) * (len(w) - sum(w)) / (len(w) * (len(w) - 1)) for w in repeated)
    return var**0.5 / len(repeated)


def evaluate(
    store: Store,
    gateway_url: str,
    agent: AgentFn,
    reward_fn: RewardFn | None,
    tasks: list[Task],
    repeats: int = 1,
    cfg: RunnerConfig | None = None,
    desc: str = "eval",
    model: str = "policy",
    threshold: float = 1.0,
    assets: dict[str, int] | None = None,
) -> EvalReport:
    """Run and summarise an evaluation; the agent is told to call `model`; success is a
    reward >= threshold; every rollout is given `assets` (see run_rollouts)."""
    started = time.perf_counter()
    rollouts = run_rollouts(
        store, gateway_url, agent, reward_fn, tasks, repeats, cfg, desc=desc, model=model,
        threshold=threshold, assets=assets,
    )  # fmt: skip
    return report(store, rollouts, time.perf_counter() - started, threshold)


def print_report(rep: EvalReport, console: Console) -> None:
    """The report as a person reads it: success first, then how the model was used."""
    console.print(
        f"[bold green]success {rep.success_rate:.1%}[/bold green] over {rep.rollouts} rollouts"
        f" · mean reward {rep.mean_reward:.3f} · {rep.mean_calls:.2f} calls/rollout"
        f" · {rep.wall_s:.1f} s"
    )
    console.print(
        f"statuses {rep.statuses} · prompt {rep.mean_prompt_tokens:.0f} tok/call · "
        f"completion {rep.mean_completion_tokens:.1f} tok/call · reused "
        f"{rep.reused_fraction:.1%} of prompt tokens · {rep.prefix_breaks} prefix breaks "
        f"· {rep.completion_tokens_per_s:.0f} completion tok/s"
    )
    if rep.pass_se is not None:
        console.print(
            f"sampling noise of one pass over the tasks: ±{rep.pass_se:.1%} (standard error)"
        )
    if len(rep.roles) > 1:
        for role, st in rep.roles.items():
            console.print(
                f"role {role}: {st.calls_per_rollout:.2f} calls/rollout · "
                f"{st.agents_per_rollout:.2f} agents/rollout · "
                f"{st.completion_tokens_per_call:.1f} completion tok/call"
            )
