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

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from tracerl.algorithms import GRPO, RLOO, Algorithm, DrGRPO, compute_advantages
from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.curation import Curator, rollout_costs
from tracerl.engines.base import Engine
from tracerl.runner import AgentFn, RewardFn, Runner, RunnerConfig
from tracerl.sources import (
    AsyncSource,
    Group,
    GroupSize,
    RolloutSource,
    SourceStats,
    SyncSource,
    TaskOrder,
    is_trainable,
)
from tracerl.store import Store
from tracerl.trainer.trainer import Trainer, TrainMetrics
from tracerl.types import PolicyVersion, Rollout, Task, Transition

__all__ = [
    "AlgorithmConfig",
    "Checkpoints",
    "Group",
    "Pipeline",
    "PipelineConfig",
    "RolloutSource",
    "StepReport",
    "TaskOrder",
    "make_source",
    "rows_for",
]


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

    mode: Literal["sync", "async"] = "sync"
    """'sync': each step generates its batch, then trains on it. 'async': runners and the
    engine keep generating while the trainer trains (see tracerl.sources.AsyncSource)."""
    max_staleness: int = Field(default=2, ge=0)
    """async: a rollout sampled by a policy older than current - max_staleness is not
    trained on; also bounds how far generation runs ahead ((k + 1) x tasks_per_step groups
    pending at most)."""
    window: int | None = Field(default=None, ge=1)
    """async: the trainer may take any complete group among the oldest `window` pending
    ones (windowed FIFO); default 2 x tasks_per_step."""
    stale: Literal["drop", "requeue"] = "requeue"
    """async: what happens to a too-stale rollout: dropped, or its task re-run in the same
    group (counted either way in metrics)."""
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


def rows_for(store: Store, groups: list[Group], algorithm: Algorithm) -> list[Transition]:
    """Spans of finished groups -> credit-assigned rows."""
    rows: list[Transition] = []
    for group in groups:
        for r in group.rollouts:
            if not is_trainable(r):
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

    def save(
        self,
        trainer: Trainer,
        step: int,
        trained: list[str],
        state: dict[str, object] | None = None,
    ) -> Path:
        """Write a checkpoint for `step` (the number of steps done)."""
        path = self.root / f"step-{step}"
        tmp = self.root / f".step-{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        trainer.save_model(tmp / "model")
        torch.save(trainer.state(), tmp / "trainer.pt")
        info = {"step": step, "trained": trained, "state": state or {}}
        (tmp / "pipeline.json").write_text(json.dumps(info))
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

    def restore(self, trainer: Trainer) -> tuple[int, list[str], dict[str, object]]:
        """Load the newest checkpoint into `trainer`; returns (step, trained rollout ids,
        the state of the source and curation)."""
        path = self.latest()
        if path is None:
            return 0, [], {}
        trainer.load_weights(path / "model")
        trainer.load_state(torch.load(path / "trainer.pt", weights_only=False))
        info = json.loads((path / "pipeline.json").read_text())
        return int(info["step"]), list(info["trained"]), dict(info.get("state", {}))


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
    source: SourceStats
    curation: dict[str, float]


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
        curator: Curator | None = None,
    ) -> None:
        self.source, self.store, self.engine = source, store, engine
        self.trainer, self.algorithm, self.checkpoints = trainer, algorithm, checkpoints
        self.cfg, self.role, self.curator = cfg, role, curator
        self.step = 0
        self.trained: list[str] = []

    def resume(self) -> int:
        """Restore the newest checkpoint and serve its weights; returns the step to run."""
        self.step, self.trained, state = self.checkpoints.restore(self.trainer)
        self.source.load_state(state.get("source", {}))  # type: ignore[arg-type]
        if self.curator is not None:
            self.curator.load_state(state.get("curation", {}))  # type: ignore[arg-type]
        if self.step:
            self.publish()
        return self.step

    def publish(self) -> None:
        """Serve the trainer's weights as its current version and record the version."""
        version = self.trainer.version
        self.engine.load_state_dict(self.trainer.engine_state_dict(), version)  # type: ignore[attr-defined]
        path = str(self.checkpoints.root / f"step-{self.step}" / "model")
        self.store.publish_version(PolicyVersion(version=version, path=path, role=self.role))

    def _untrained(self, group: Group) -> list[Rollout]:
        """The group's rollouts not trained on before (a resumed step's), plus any replayed
        from another group (replay trains a stored success again, on purpose)."""
        done = set(self.trained)
        return [r for r in group.rollouts if r.id not in done or r.group_id != group.id]

    def run_step(self) -> StepReport:
        """Generate (or collect) one batch, train on it, publish, checkpoint."""
        started = time.perf_counter()
        groups = self.source.batch(self.step)
        generated = time.perf_counter() - started
        fresh = [Group(g.id, g.task, self._untrained(g)) for g in groups]
        rows = rows_for(self.store, fresh, self.algorithm)
        if self.curator is not None and self.curator.needs_costs:
            costs = rollout_costs(self.store, fresh, self.curator.cfg.secondary)
            rows = self.curator.advantages(rows, costs)
        rollouts = [r for g in fresh for r in g.rollouts]
        metrics = self.trainer.train(rows)
        self.step += 1
        self.trained += [r.id for g in fresh for r in g.rollouts if r.group_id == g.id]
        self.publish()
        if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
            state: dict[str, object] = {"source": self.source.state()}
            if self.curator is not None:
                state["curation"] = self.curator.state()
            self.checkpoints.save(self.trainer, self.step, self.trained, state)
        rewards = [r.reward or 0.0 for r in rollouts]
        return StepReport(
            step=self.step,
            reward=sum(rewards) / max(len(rewards), 1),
            success=sum(x >= 1.0 for x in rewards) / max(len(rewards), 1),
            rollouts=len(rollouts),
            rows=len(rows),
            generate_s=generated,
            train=metrics,
            source=self.source.stats,
            curation=self.curator.metrics() if self.curator is not None else {},
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
    version: Callable[[], int] | None = None,
    curator: Curator | None = None,
) -> SyncSource | AsyncSource:
    """The rollout source for cfg.mode; `version` (the trainer's) is needed for 'async'."""
    runner = Runner(store, gateway_url, agent, reward_fn, runner_cfg, on_finish=on_finish)
    order = TaskOrder(tasks, cfg.tasks_per_step, cfg.seed)
    size: int | GroupSize = cfg.group_size
    curate = None
    if curator is not None:
        size, curate = (lambda t: curator.group_size(t.id)), curator.curate
    if cfg.mode == "sync":
        return SyncSource(run, store, runner, order, size, curate=curate)
    if version is None:
        raise ValueError("the async source needs the trainer's version")
    return AsyncSource(
        run,
        store,
        runner,
        order,
        size,
        version,
        max_staleness=cfg.max_staleness,
        window=cfg.window,
        stale=cfg.stale,
        curate=curate,
    )
