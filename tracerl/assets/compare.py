"""Intervention evaluation: the same tasks run with two versions of an asset, paired.

Each arm is a group of rollouts through the gateway, one per (task, repeat), given the
arm's version (Rollout.assets; 0 runs without the asset) and the seed of its (task,
repeat) (Rollout.seed), the same in both arms: an engine that takes per-request seeds (the
transformers one) then draws the same random numbers for both, so the arms differ by the
asset and not by luck of the draw. The pairs say what B repairs and what it breaks, and the
paired test (stats.py) whether the difference is more than chance. The comparison is
recorded in the store with every rollout's id, so each pair's two traces can be read.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from tracerl.agents import AgentFn, RewardFn
from tracerl.assets.records import AssetRef, Comparison, Pair, Test
from tracerl.assets.stats import discordant, p_value, success_rate
from tracerl.evaluate import run_rollouts
from tracerl.runner import RunnerConfig
from tracerl.store import Store
from tracerl.types import SEED_LIMIT, Rollout, Task, bounded_reward

__all__ = ["Arena", "ArmResult", "Outcome", "compare", "pair_key", "pair_seed", "paired", "run_arm"]


@dataclass(frozen=True)
class Arena:
    """Where arms run: a store and gateway serving the policy, the agent and its reward."""

    store: Store
    """The store the gateway records into (and the assets are read from)."""
    gateway_url: str
    """Base URL of the gateway the agent calls."""
    agent: AgentFn
    """The agent, unchanged."""
    reward_fn: RewardFn | None
    """Its reward, when it neither returns nor posts one."""
    runner: RunnerConfig
    """Concurrency, timeouts."""
    model: str = "policy"
    """The model name the agent is told to call."""
    threshold: float = 1.0
    """A rollout with an outcome and a reward at or above this is a success."""

    def version(self, ref: AssetRef) -> int:
        """The version a reference names (its current one when it names none; NotFound for
        one the store lacks); 0 stays 0: without the asset."""
        if ref.version == 0:
            return 0
        return self.store.asset(ref.name, ref.version).version


class Outcome(BaseModel):
    """How one rollout of an arm ended."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rollout_id: str
    """The rollout."""
    success: bool
    """An outcome with reward >= the threshold."""
    reward: float
    """Its final reward (a missing one as 0)."""


class ArmResult(BaseModel):
    """One arm: a version of an asset run on tasks, keyed by pair_key(task, repeat)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """The asset."""
    version: int
    """Its version (0: without it)."""
    group_id: str
    """The arm's rollouts' group in the store."""
    outcomes: dict[str, Outcome]
    """Each (task, repeat)'s outcome."""

    def solved(self) -> set[str]:
        """The pairs it solved."""
        return {k for k, o in self.outcomes.items() if o.success}


def pair_key(task_id: str, repeat: int) -> str:
    """How a (task, repeat) is named in arm results and candidates: 'task#repeat'."""
    return f"{task_id}#{repeat}"


def pair_seed(seed: int, task_id: str, repeat: int) -> int:
    """The sampling seed of one (task, repeat): a function of the base seed and the pair
    only, so every arm, in any process, gives that pair the same one."""
    digest = hashlib.blake2b(f"{seed}/{task_id}/{repeat}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % SEED_LIMIT


def run_arm(
    arena: Arena,
    name: str,
    version: int,
    tasks: list[Task],
    repeats: int = 1,
    seed: int = 0,
    desc: str | None = None,
) -> ArmResult:
    """Run every task `repeats` times with `version` of asset `name` (0: without it)."""
    keys = [(t.id, r) for t in tasks for r in range(repeats)]
    seeds = [pair_seed(seed, t, r) for t, r in keys]
    by_seed = dict(zip(seeds, keys, strict=True))
    group = f"assets/{name}@{version}/{uuid.uuid4().hex[:8]}"
    rollouts = run_rollouts(
        arena.store, arena.gateway_url, arena.agent, arena.reward_fn, tasks, repeats,
        arena.runner, group_id=group, desc=desc or f"{name}@{version}", model=arena.model,
        threshold=arena.threshold, assets={name: version}, seeds=seeds,
    )  # fmt: skip
    outcomes = {}
    for r in rollouts:  # a rollout's seed says which (task, repeat) it ran
        assert r.seed is not None, "every rollout of an arm is given a seed"
        outcomes[pair_key(*by_seed[r.seed])] = _outcome(r, arena.threshold)
    return ArmResult(name=name, version=version, group_id=group, outcomes=outcomes)


def _outcome(r: Rollout, threshold: float) -> Outcome:
    reward = bounded_reward(r.reward)
    success = r.has_outcome and reward >= threshold
    return Outcome(rollout_id=r.id, success=success, reward=reward)


def paired(
    a: ArmResult,
    b: ArmResult,
    test: Test = "mcnemar",
    seed: int = 0,
    purpose: str = "compare",
    optimization: str | None = None,
) -> Comparison:
    """The comparison of two arms over the pairs both ran (ValueError if they ran none in
    common: nothing to pair)."""
    if a.name != b.name:
        raise ValueError(f"arms of different assets: {a.name!r}, {b.name!r}")
    common = [k for k in a.outcomes if k in b.outcomes]
    if not common:
        raise ValueError("the arms share no (task, repeat): nothing to pair")
    pairs = [_pair(k, a.outcomes[k], b.outcomes[k]) for k in common]
    repairs, regressions = discordant(pairs)
    return Comparison(
        id=uuid.uuid4().hex[:16], name=a.name, a=a.version, b=b.version, pairs=pairs,
        success_a=success_rate(pairs, "a"), success_b=success_rate(pairs, "b"),
        repairs=repairs, regressions=regressions, p_value=p_value(pairs, test, seed),
        test=test, purpose=purpose, optimization=optimization, seed=seed,
        created_at=time.time(),
    )  # fmt: skip


def _pair(key: str, a: Outcome, b: Outcome) -> Pair:
    task_id, _, repeat = key.rpartition("#")
    return Pair(
        task_id=task_id, repeat=int(repeat), a=a.success, b=b.success,
        rollout_a=a.rollout_id, rollout_b=b.rollout_id,
    )  # fmt: skip


def compare(
    arena: Arena,
    a: AssetRef,
    b: AssetRef,
    tasks: list[Task],
    repeats: int = 1,
    seed: int = 0,
    test: Test = "mcnemar",
) -> Comparison:
    """Run both versions on the tasks, paired, and record the comparison in the store."""
    if a.name != b.name:
        raise ValueError(f"compare two versions of one asset, not {a} and {b}")
    va, vb = arena.version(a), arena.version(b)
    arm_a = run_arm(arena, a.name, va, tasks, repeats, seed)
    arm_b = run_arm(arena, b.name, vb, tasks, repeats, seed)
    comparison = paired(arm_a, arm_b, test, seed)
    arena.store.add_comparison(comparison)
    return comparison
