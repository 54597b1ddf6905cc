"""One training step: the only place that knows both sides, rollouts in and updates out.

Each step takes a batch of finished groups from a rollout source (tracerl.pipeline.sources;
every finished rollout is read from the store once, spans and rewards included), turns
them into credit-assigned rows (tracerl.algorithms: advantages within groups per role,
then curation's adjustments), lets each policy (tracerl.trainer) train on the rows of the
roles it plays, publishes the new weights to each policy's engine, and checkpoints. Rows of
frozen roles (in no policy) are counted and never trained.

Resuming is exact (tracerl.pipeline.checkpoints): weights, optimizer, schedule and RNG
states, the step, the source's and curation's state. Group ids are a function of the run
and the task's position, so after a crash the interrupted step's rollouts are found in the
store and used, not generated or trained twice.

Policy versions are the store's (Store.issue_version): every publish (each step, a resume,
a rollback, an earlier checkpoint loaded to be evaluated) serves the weights under a new
number, above every number the store issued before. So the steps after a resumed
checkpoint never reuse the numbers the lost weights' spans carry, and staleness
(current - a span's version) is never negative.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from tracerl.algorithms.advantages import Algorithm
from tracerl.algorithms.curation import Curation
from tracerl.algorithms.rows import rows_for
from tracerl.engines.base import Engine
from tracerl.pipeline.checkpoints import Checkpoints, PipelineState, Trainers
from tracerl.pipeline.config import PipelineConfig
from tracerl.pipeline.guards import BatchStats, batch_stats
from tracerl.pipeline.sources import RolloutSource, SourceStats
from tracerl.store import Store
from tracerl.trainer.lead import Leader
from tracerl.trainer.trainer import Trainer, TrainMetrics
from tracerl.types import Group, PolicyVersion, Transition

__all__ = ["Pipeline", "Policy", "StepReport", "local_trainer"]


@dataclass
class Policy:
    """One set of trainable weights: its trainer, the engine serving it, the roles it plays.

    A role is the `model` name agents ask for. Several roles may share one policy (one
    backbone); a role in no policy is frozen: served and recorded, never trained.
    """

    name: str
    trainer: Trainer | Leader
    """Its trainer: a Trainer, or rank 0's Leader of data-parallel ranks."""
    engine: Engine
    roles: list[str]


def local_trainer(policy: Policy, change: str) -> Trainer:
    """A policy's trainer, for a change made to its optimizer in place (`change`: a new
    learning rate, a rollback). A Leader's ranks would each need the change, and they take
    none mid-run: refused with a ValueError that says so, before anything changed."""
    if isinstance(policy.trainer, Leader):
        raise ValueError(
            f"{change} is not possible in a data-parallel run: its trainer ranks take no "
            "optimizer changes mid-run"
        )
    return policy.trainer


@dataclass
class StepReport:
    """What one pipeline step did."""

    step: int
    reward: float
    """Mean final reward over the batch's rollouts (a missing one read as 0)."""
    success: float
    """Share of the batch's rollouts at or above the run's success threshold."""
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
    batch: BatchStats = field(default_factory=BatchStats)
    """What the guard rails read of the batch: mixed groups, entropy, lengths, errors."""


class Pipeline:
    """The training loop over a rollout source; see the module docstring.

    Every policy is served under one version number, each trainer's `version` (what its
    checkpoint saves, and what the async source reads as current): a span's staleness is
    `current - span.policy_version` whichever policy sampled it. A policy whose roles made
    no call in a batch is republished unchanged under the new number.
    """

    def __init__(
        self,
        source: RolloutSource,
        store: Store,
        policies: list[Policy],
        algorithm: Algorithm,
        curation: Curation,
        checkpoints: Checkpoints,
        cfg: PipelineConfig,
        success_threshold: float = 1.0,
    ) -> None:
        if not policies:
            raise ValueError("a pipeline needs at least one trainable policy")
        self.source, self.store, self.policies = source, store, policies
        self.algorithm, self.curation, self.checkpoints = algorithm, curation, checkpoints
        self.cfg, self.success_threshold = cfg, success_threshold
        self.step = 0
        self.rollouts_trained = 0
        self.roles = [role for p in policies for role in p.roles]
        start = max(p.engine.policy_version for p in policies)
        # On record, so every number issued later is above it: the stack issued it (this
        # is a no-op then); a stack built by hand may not have.
        for role in self.roles:
            self.store.publish_version(PolicyVersion(version=start, role=role))
        self._adopt(start)

    def _adopt(self, version: int) -> None:
        """Every policy's weights are now served under `version` (a Leader's followers
        never have theirs read: rank 0 checkpoints and publishes)."""
        for p in self.policies:
            t = p.trainer.trainer if isinstance(p.trainer, Leader) else p.trainer
            t.version = version

    @property
    def trainers(self) -> Trainers:
        """What checkpoints hold: the one trainer, or every policy's by name."""
        if len(self.policies) == 1:
            return self.policies[0].trainer
        several: dict[str, Trainer] = {}
        for p in self.policies:
            if not isinstance(p.trainer, Trainer):
                raise TypeError("data-parallel ranks (a Leader) train one-policy runs only")
            several[p.name] = p.trainer
        return several

    def resume(self) -> int:
        """Restore the newest checkpoint (if any) and serve its weights under a new version
        (the one it saved may be carried by spans of weights trained after it, then lost);
        returns the step to run."""
        state = self.checkpoints.restore(self.trainers)
        self.step, self.rollouts_trained = state.step, state.rollouts_trained
        self.source.load_state(state.source)
        self.curation.load_state(state.curation)
        self.publish(checkpointed=self.checkpoints.exists(self.step))
        return self.step

    def publish(self, checkpointed: bool) -> None:
        """Serve every trainer's weights under a version number the store issues now; with
        `checkpointed`, record this step's checkpoint as holding them."""
        self._adopt(self.store.issue_version(self.roles))
        for p in self.policies:
            p.engine.load_state_dict(p.trainer.engine_state_dict(), p.trainer.version)
        if checkpointed:
            self._record_checkpoint()

    def _record_checkpoint(self) -> None:
        """Record this step's checkpoint dir as holding each role's current version (once
        it is written: a version's path always exists)."""
        several = len(self.policies) > 1
        for p in self.policies:
            path = str(self.checkpoints.model_dir(self.step, p.name if several else None))
            for role in p.roles:
                self.store.publish_version(
                    PolicyVersion(version=p.trainer.version, path=path, role=role)
                )

    def _train(self, rows: list[Transition]) -> dict[str, TrainMetrics | None]:
        """Each policy trains on its roles' rows; one without rows keeps its weights (and
        gets the next version with the others when they are published)."""
        out: dict[str, TrainMetrics | None] = {}
        for p in self.policies:
            mine = [r for r in rows if r.role in p.roles]
            out[p.name] = p.trainer.train(mine) if mine else None
        return out

    def run_step(self) -> StepReport:
        """Generate (or collect) one batch, train on it, publish, checkpoint."""
        started = time.perf_counter()
        groups = self.source.batch(self.step)
        generated = time.perf_counter() - started
        rows = rows_for(groups, self.algorithm, self.curation)
        per_policy = self._train(rows)
        self.step += 1
        # Replayed rollouts (from another group) were recorded when first trained.
        ids = [f.id for g in groups for f in g.rollouts if f.rollout.group_id == g.id]
        self.rollouts_trained += len(ids)
        self.checkpoints.record(self.step, ids)
        self.publish(checkpointed=False)  # engines switch first: generation goes on meanwhile
        if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
            self.save_checkpoint()
        return self._report(groups, rows, per_policy, generated)

    def save_checkpoint(self) -> None:
        """Checkpoint the trainers and the pipeline's state as of `self.step`, and record
        it as holding the versions being served (the trainers' weights)."""
        state = PipelineState(
            step=self.step,
            rollouts_trained=self.rollouts_trained,
            source=self.source.state(),
            curation=self.curation.state(),
        )
        self.checkpoints.save(self.trainers, state)
        self._record_checkpoint()

    def _report(
        self,
        groups: list[Group],
        rows: list[Transition],
        per_policy: dict[str, TrainMetrics | None],
        generate_s: float,
    ) -> StepReport:
        rollouts = [f for g in groups for f in g.rollouts]
        n = max(len(rollouts), 1)
        trained_roles = {role for p in self.policies for role in p.roles}
        first = next((m for m in per_policy.values() if m is not None), None)
        return StepReport(
            step=self.step,
            reward=sum(f.reward for f in rollouts) / n,
            success=sum(f.success(self.success_threshold) for f in rollouts) / n,
            rollouts=len(rollouts),
            rows=len(rows),
            generate_s=generate_s,
            train=first or TrainMetrics.empty(),
            source=self.source.stats,
            curation=self.curation.metrics(),
            policies=per_policy,
            frozen_rows=sum(r.role not in trained_roles for r in rows),
            role_rows=dict(Counter(r.role for r in rows)),
            batch=batch_stats(groups, self.success_threshold),
        )
