"""The pipeline: the only place that knows both sides — rollouts in, policy updates out.

Each step takes a batch of finished groups from a rollout source (tracerl.sources), turns
their spans into credit-assigned rows (tracerl.algorithms; advantages are computed within
groups per role), lets each policy (tracerl.trainer) train on the rows of the roles it plays,
publishes the new weights to each policy's engine, and checkpoints. Rows of frozen roles
(in no policy) are recorded and never trained. The source is the boundary between
generation and training: the synchronous source issues tasks x group_size rollouts and waits
for them; the asynchronous one keeps generating while the trainer trains and hands over
complete groups within a staleness bound.

Resuming is exact: a checkpoint holds the weights, optimizer, schedule and RNG states (one
folder per policy when there are several), the step, the ids of every rollout trained on,
and the state of the source and of curation. Group ids are a function of the run and the
task's position, so after a crash the interrupted step's rollouts are found in the store and
used, not generated or trained twice.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tracerl.algorithms import Algorithm, compute_advantages
from tracerl.algorithms.curation import Curator, rollout_costs
from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.engines.base import Engine
from tracerl.pipeline.config import PipelineConfig
from tracerl.pipeline.sources import (
    AsyncSource,
    Group,
    GroupSize,
    RolloutSource,
    SourceStats,
    SyncSource,
    TaskOrder,
    is_trainable,
)
from tracerl.runner import AgentFn, RewardFn, Runner, RunnerConfig
from tracerl.store import Store
from tracerl.trainer.trainer import Trainer, TrainMetrics
from tracerl.types import PolicyVersion, Rollout, Task, Transition

__all__ = [
    "Checkpoints",
    "Group",
    "Pipeline",
    "Policy",
    "RolloutSource",
    "StepReport",
    "TaskOrder",
    "make_source",
    "rows_for",
]


def rows_for(store: Store, groups: list[Group], algorithm: Algorithm) -> list[Transition]:
    """Spans of finished groups -> credit-assigned rows."""
    rows: list[Transition] = []
    for group in groups:
        for r in group.rollouts:
            if not is_trainable(r):
                continue  # timed out by the runner or lost: no outcome to learn from
            rewards = store.rewards(r.id, r.attempt)
            steps = {w.span_seq: w.value for w in rewards if w.span_seq is not None}
            by_role = {w.role: w.value for w in rewards if w.role is not None}  # last wins
            rows += spans_to_transitions(
                store.spans(r.id, r.attempt),
                r.reward or 0.0,
                steps or None,
                by_role or None,
                group_id=group.id,
                task_id=group.task.id,
            )
    return compute_advantages(algorithm, rows)


@dataclass
class Policy:
    """One set of trainable weights: its trainer, the engine serving it, the roles it plays.

    A role is the `model` name agents ask for. Several roles may share one policy (one
    backbone); a role in no policy is frozen: served and recorded, never trained.
    """

    name: str
    trainer: Trainer
    engine: Engine
    roles: list[str]


Trainers = Trainer | dict[str, Trainer]
"""One trainer (files at the checkpoint's root) or several by policy name (a folder each)."""


class Checkpoints:
    """runs/<name>/checkpoints/step-<k>/ with a `latest` pointer replaced atomically."""

    def __init__(self, run_dir: Path, keep: int) -> None:
        self.root = run_dir / "checkpoints"
        self.keep = keep

    @staticmethod
    def _dirs(trainers: Trainers, path: Path) -> list[tuple[Trainer, Path]]:
        if isinstance(trainers, Trainer):
            return [(trainers, path)]
        return [(t, path / name) for name, t in trainers.items()]

    def save(
        self,
        trainers: Trainers,
        step: int,
        trained: list[str],
        state: dict[str, object] | None = None,
    ) -> Path:
        """Write a checkpoint for `step` (the number of steps done)."""
        path = self.root / f"step-{step}"
        tmp = self.root / f".step-{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for trainer, where in self._dirs(trainers, tmp):
            trainer.save_model(where / "model")
            torch.save(trainer.state(), where / "trainer.pt")
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

    def restore(self, trainers: Trainers) -> tuple[int, list[str], dict[str, object]]:
        """Load the newest checkpoint into the trainer(s); returns (step, trained rollout
        ids, the state of the source and curation)."""
        path = self.latest()
        if path is None:
            return 0, [], {}
        for trainer, where in self._dirs(trainers, path):
            trainer.load_weights(where / "model")
            trainer.load_state(torch.load(where / "trainer.pt", weights_only=False))
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
    """The first policy's update (the only one in a single-policy run)."""
    source: SourceStats
    curation: dict[str, float]
    policies: dict[str, TrainMetrics | None] = field(default_factory=dict)
    """Every policy's update by name; None when the batch held no rows of its roles."""
    frozen_rows: int = 0
    """Rows of frozen roles (recorded, not trained)."""
    role_rows: dict[str, int] = field(default_factory=dict)
    """Rows of each role in the batch (after alignment, if any)."""


class Pipeline:
    """The training loop over a rollout source; see the module docstring.

    Every policy's version equals the number of steps done, so a span's staleness is
    `step - span.policy_version` whichever policy sampled it; a policy whose roles made
    no call in a batch is republished unchanged under the new version.
    """

    def __init__(
        self,
        source: RolloutSource,
        store: Store,
        policies: list[Policy],
        algorithm: Algorithm,
        checkpoints: Checkpoints,
        cfg: PipelineConfig,
        curator: Curator | None = None,
    ) -> None:
        if not policies:
            raise ValueError("a pipeline needs at least one trainable policy")
        self.source, self.store, self.policies = source, store, policies
        self.algorithm, self.checkpoints = algorithm, checkpoints
        self.cfg, self.curator = cfg, curator
        self.step = 0
        self.trained: list[str] = []

    @property
    def trainers(self) -> Trainers:
        """What checkpoints hold: the one trainer, or every policy's by name."""
        if len(self.policies) == 1:
            return self.policies[0].trainer
        return {p.name: p.trainer for p in self.policies}

    def resume(self) -> int:
        """Restore the newest checkpoint and serve its weights; returns the step to run."""
        self.step, self.trained, state = self.checkpoints.restore(self.trainers)
        self.source.load_state(state.get("source", {}))  # type: ignore[arg-type]
        if self.curator is not None:
            self.curator.load_state(state.get("curation", {}))  # type: ignore[arg-type]
        if self.step:
            self.publish()
        return self.step

    def publish(self) -> None:
        """Serve every trainer's weights as its current version and record the versions."""
        several = len(self.policies) > 1
        for p in self.policies:
            version = p.trainer.version
            p.engine.load_state_dict(p.trainer.engine_state_dict(), version)  # type: ignore[attr-defined]
            where = self.checkpoints.root / f"step-{self.step}"
            path = str((where / p.name if several else where) / "model")
            for role in p.roles:
                self.store.publish_version(PolicyVersion(version=version, path=path, role=role))

    def _untrained(self, group: Group) -> list[Rollout]:
        """The group's rollouts not trained on before (a resumed step's), plus any replayed
        from another group (replay trains a stored success again, on purpose)."""
        done = set(self.trained)
        return [r for r in group.rollouts if r.id not in done or r.group_id != group.id]

    def _train(self, rows: list[Transition]) -> dict[str, TrainMetrics | None]:
        """Each policy trains on its roles' rows; one without rows keeps its weights."""
        out: dict[str, TrainMetrics | None] = {}
        for p in self.policies:
            mine = [r for r in rows if r.role in p.roles]
            if mine:
                out[p.name] = p.trainer.train(mine)
            else:
                out[p.name] = None
                p.trainer.version += 1  # same weights, next version: versions stay in step
        return out

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
        per_policy = self._train(rows)
        self.step += 1
        self.trained += [r.id for g in fresh for r in g.rollouts if r.group_id == g.id]
        self.publish()
        if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
            state: dict[str, object] = {"source": self.source.state()}
            if self.curator is not None:
                state["curation"] = self.curator.state()
            self.checkpoints.save(self.trainers, self.step, self.trained, state)
        rewards = [r.reward or 0.0 for r in rollouts]
        trained_roles = {role for p in self.policies for role in p.roles}
        first = next((m for m in per_policy.values() if m is not None), None)
        return StepReport(
            step=self.step,
            reward=sum(rewards) / max(len(rewards), 1),
            success=sum(x >= 1.0 for x in rewards) / max(len(rewards), 1),
            rollouts=len(rollouts),
            rows=len(rows),
            generate_s=generated,
            train=first or TrainMetrics.empty(),
            source=self.source.stats,
            curation=self.curator.metrics() if self.curator is not None else {},
            policies=per_policy,
            frozen_rows=sum(r.role not in trained_roles for r in rows),
            role_rows=dict(Counter(r.role for r in rows)),
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
    trained_roles: Collection[str] | None = None,
) -> SyncSource | AsyncSource:
    """The rollout source for cfg.mode; `version` (the trainer's) is needed for 'async',
    `trained_roles` (default: all) for its staleness (frozen roles never age)."""
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
        trained_roles=trained_roles,
    )
