"""The pipeline: the only place that knows both sides — rollouts in, policy updates out.

Each step takes a batch of finished groups from a rollout source, turns their spans into
credit-assigned rows (tracerl.algorithms), updates the policy (tracerl.trainer), publishes
the new weights to the engine, and checkpoints. The source is the boundary between
generation and training: the synchronous source issues tasks x group_size rollouts and waits
for them; an asynchronous source keeps generating while the trainer trains and hands over
complete groups within a staleness bound.

Resuming is exact: a checkpoint holds the weights, optimizer, schedule and RNG states, the
step, and the ids of every rollout trained on. Group ids are a function of (run, step,
task), so after a crash the interrupted step's rollouts are found in the store and used,
not generated or trained twice.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from tracerl.algorithms import GRPO, RLOO, Algorithm, DrGRPO, compute_advantages
from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.engines.base import Engine
from tracerl.runner import AgentFn, RewardFn, Runner, RunnerConfig
from tracerl.store import Store
from tracerl.trainer.trainer import Trainer, TrainMetrics
from tracerl.types import PolicyVersion, Rollout, RolloutStatus, Task, Transition


class AlgorithmConfig(BaseModel):
    """Credit assignment: how rewards become per-token advantages."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    name: Literal["grpo", "rloo", "drgrpo"] = "grpo"
    """GRPO (group baseline, std scaling), RLOO (leave-one-out), Dr.GRPO (unnormalised)."""
    scale_by_std: bool = True
    """GRPO only: divide by the group's reward std."""
    normalize: Literal["token", "sequence", "none"] = "token"
    """Per-rollout weighting so a rollout with more calls does not weigh more."""

    def build(self) -> Algorithm:
        """The algorithm object."""
        if self.name == "grpo":
            return GRPO(scale_by_std=self.scale_by_std, normalize=self.normalize)
        if self.name == "rloo":
            return RLOO(normalize=self.normalize)
        return DrGRPO(normalize=self.normalize)


class PipelineConfig(BaseModel):
    """Scheduling of generation and training."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    mode: Literal["sync"] = "sync"
    """'sync': each step generates its batch, then trains on it."""
    steps: int = Field(default=30, ge=1)
    """Training steps (policy versions published)."""
    tasks_per_step: int = Field(default=16, ge=1)
    """Tasks per step; each is attempted group_size times."""
    group_size: int = Field(default=8, ge=1)
    """Rollouts per task sharing a baseline."""
    eval_every: int = Field(default=5, ge=0)
    """Held-out evaluation every this many steps (0: only before and after)."""
    eval_size: int = Field(default=100, ge=1)
    """Held-out tasks per periodic evaluation."""
    checkpoint_every: int = Field(default=1, ge=1)
    """Steps between checkpoints."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Checkpoints kept on disk."""
    seed: int = 0
    """Seed of the task order."""


@dataclass
class Group:
    """The finished rollouts of one task in one step."""

    id: str
    task: Task
    rollouts: list[Rollout]


class RolloutSource(Protocol):
    """Where training batches come from; the seam between generation and training."""

    def batch(self, step: int) -> list[Group]:
        """Finished groups to train on at `step`."""
        ...


class TaskOrder:
    """Train tasks in a seeded order that reshuffles each epoch; position = step index."""

    def __init__(self, tasks: list[Task], per_step: int, seed: int) -> None:
        self.tasks, self.per_step, self.seed = tasks, per_step, seed

    def at(self, step: int) -> list[Task]:
        """The tasks of `step` (a pure function of step, so resuming needs no cursor)."""
        out = []
        for k in range(step * self.per_step, (step + 1) * self.per_step):
            epoch, pos = divmod(k, len(self.tasks))
            order = list(range(len(self.tasks)))
            random.Random(self.seed * 100_003 + epoch).shuffle(order)
            out.append(self.tasks[order[pos]])
        return out


class SyncSource:
    """Issues a step's rollouts and waits for all of them (reusing any already issued)."""

    def __init__(
        self,
        run: str,
        store: Store,
        runner: Runner,
        order: TaskOrder,
        group_size: int,
        max_attempts: int = 3,
    ) -> None:
        self.run, self.store, self.runner = run, store, runner
        self.order, self.group_size, self.max_attempts = order, group_size, max_attempts

    def group_id(self, step: int, index: int, task: Task) -> str:
        """Deterministic, so a resumed run finds the groups it had issued."""
        return f"{self.run}/step{step}/{index}-{task.id}"

    def batch(self, step: int) -> list[Group]:
        tasks = self.order.at(step)
        self.store.add_tasks(list({t.id: t for t in tasks}.values()))
        ids = []
        for i, task in enumerate(tasks):
            gid = self.group_id(step, i, task)
            if not self.store.rollouts(group_id=gid):
                self.store.enqueue([task.id] * self.group_size, gid, self.max_attempts)
            ids.append(gid)
        asyncio.run(self.runner.run(until_idle=True))
        return [
            Group(gid, task, self.store.rollouts(group_id=gid))
            for gid, task in zip(ids, tasks, strict=True)
        ]


def rows_for(store: Store, groups: list[Group], algorithm: Algorithm) -> list[Transition]:
    """Spans of finished groups -> credit-assigned rows."""
    rows: list[Transition] = []
    for group in groups:
        for r in group.rollouts:
            if r.status not in (RolloutStatus.succeeded, RolloutStatus.failed):
                continue  # timed out by the runner or lost: no outcome to learn from
            steps = {w.span_seq: w.value for w in store.rewards(r.id) if w.span_seq is not None}
            rows += spans_to_transitions(
                store.spans(r.id),
                r.reward or 0.0,
                {k: v for k, v in steps.items() if k is not None} or None,
                group_id=group.id,
                task_id=group.task.id,
            )
    return compute_advantages(algorithm, rows)


class Checkpoints:
    """runs/<name>/checkpoints/step-<k>/ with a `latest` pointer replaced atomically."""

    def __init__(self, run_dir: Path, keep: int) -> None:
        self.root = run_dir / "checkpoints"
        self.keep = keep

    def save(self, trainer: Trainer, step: int, trained: list[str]) -> Path:
        """Write a checkpoint for `step` (the number of steps done)."""
        path = self.root / f"step-{step}"
        tmp = self.root / f".step-{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        trainer.save_model(tmp / "model")
        torch.save(trainer.state(), tmp / "trainer.pt")
        (tmp / "pipeline.json").write_text(json.dumps({"step": step, "trained": trained}))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        pointer = self.root / ".latest.tmp"
        pointer.write_text(path.name)
        os.replace(pointer, self.root / "latest")
        self._prune()
        return path

    def _prune(self) -> None:
        done = sorted(
            (p for p in self.root.glob("step-*") if p.is_dir()),
            key=lambda p: int(p.name.split("-")[1]),
        )
        for old in done[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, if any."""
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / "pipeline.json").exists() else None

    def restore(self, trainer: Trainer) -> tuple[int, list[str]]:
        """Load the newest checkpoint into `trainer`; returns (step, trained rollout ids)."""
        path = self.latest()
        if path is None:
            return 0, []
        trainer.load_weights(path / "model")
        trainer.load_state(torch.load(path / "trainer.pt", weights_only=False))
        info = json.loads((path / "pipeline.json").read_text())
        return int(info["step"]), list(info["trained"])


@dataclass
class StepReport:
    """What one pipeline step did."""

    step: int
    reward: float
    success: float
    rollouts: int
    rows: int
    generate_s: float
    train: TrainMetrics


class Pipeline:
    """The training loop over a rollout source; see the module docstring."""

    def __init__(
        self,
        source: RolloutSource,
        store: Store,
        engine: Engine,
        trainer: Trainer,
        algorithm: Algorithm,
        checkpoints: Checkpoints,
        cfg: PipelineConfig,
        role: str = "policy",
    ) -> None:
        self.source, self.store, self.engine = source, store, engine
        self.trainer, self.algorithm, self.checkpoints = trainer, algorithm, checkpoints
        self.cfg, self.role = cfg, role
        self.step = 0
        self.trained: list[str] = []

    def resume(self) -> int:
        """Restore the newest checkpoint and serve its weights; returns the step to run."""
        self.step, self.trained = self.checkpoints.restore(self.trainer)
        if self.step:
            self.publish()
        return self.step

    def publish(self) -> None:
        """Serve the trainer's weights as its current version and record the version."""
        version = self.trainer.version
        self.engine.load_state_dict(self.trainer.engine_state_dict(), version)  # type: ignore[attr-defined]
        path = str(self.checkpoints.root / f"step-{self.step}" / "model")
        self.store.publish_version(PolicyVersion(version=version, path=path, role=self.role))

    def run_step(self) -> StepReport:
        """Generate (or collect) one batch, train on it, publish, checkpoint."""
        started = time.perf_counter()
        groups = self.source.batch(self.step)
        generated = time.perf_counter() - started
        done = set(self.trained)
        fresh = [Group(g.id, g.task, [r for r in g.rollouts if r.id not in done]) for g in groups]
        rows = rows_for(self.store, fresh, self.algorithm)
        rollouts = [r for g in fresh for r in g.rollouts]
        metrics = self.trainer.train(rows)
        self.step += 1
        self.trained += [r.id for r in rollouts]
        self.publish()
        if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
            self.checkpoints.save(self.trainer, self.step, self.trained)
        rewards = [r.reward or 0.0 for r in rollouts]
        return StepReport(
            step=self.step,
            reward=sum(rewards) / max(len(rewards), 1),
            success=sum(x >= 1.0 for x in rewards) / max(len(rewards), 1),
            rollouts=len(rollouts),
            rows=len(rows),
            generate_s=generated,
            train=metrics,
        )


def make_source(
    run: str,
    store: Store,
    gateway_url: str,
    agent: AgentFn,
    reward_fn: RewardFn | None,
    tasks: list[Task],
    cfg: PipelineConfig,
    runner_cfg: RunnerConfig,
    on_finish: Callable[[Rollout], None] | None = None,
) -> SyncSource:
    """The rollout source for cfg.mode."""
    runner = Runner(store, gateway_url, agent, reward_fn, runner_cfg, on_finish=on_finish)
    return SyncSource(
        run, store, runner, TaskOrder(tasks, cfg.tasks_per_step, cfg.seed), cfg.group_size
    )
