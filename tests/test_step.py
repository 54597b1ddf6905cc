"""One training step as the pipeline runs it: what it reads from the store, what it
records, and how it counts success."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tracerl.algorithms.advantages import GRPO
from tracerl.algorithms.config import CurationConfig
from tracerl.algorithms.curation import Curation
from tracerl.pipeline.async_source import AsyncSource
from tracerl.pipeline.checkpoints import Checkpoints, read_ledger
from tracerl.pipeline.config import PipelineConfig
from tracerl.pipeline.sources import RolloutSource, SyncSource, TaskOrder
from tracerl.pipeline.step import Pipeline, Policy
from tracerl.store import Store
from tracerl.trainer.config import TrainerConfig
from tracerl.trainer.trainer import Trainer

from .test_async import SLOW, Stack, _tasks


class CountingStore:
    """The store, counting span reads per rollout id."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.span_reads: Counter[str] = Counter()

    def spans(self, rollout_id: str, attempt: int | None = None) -> list[Any]:
        self.span_reads[rollout_id] += 1
        return self._store.spans(rollout_id, attempt)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.fixture
def stack(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tiny_model_dir, tmp_path / "traces.db")
    yield s
    s.close()
    SLOW.clear()


def _pipeline(
    stack: Stack,
    store: Any,
    model: Path,
    run: Path,
    mode: str,
    curation: Curation,
    checkpoint_every: int = 1,
    success_threshold: float = 1.0,
) -> Pipeline:
    trainer = Trainer(model, TrainerConfig(bf16=False))
    order = TaskOrder(_tasks(16), per_step=4, seed=0)
    source: RolloutSource
    if mode == "sync":
        source = SyncSource("run", store, stack.agents(), order, curation)
    else:
        source = AsyncSource("run", store, stack.agents(), order, curation, lambda: trainer.version)
    cfg = PipelineConfig(
        steps=10, tasks_per_step=4, group_size=2, checkpoint_every=checkpoint_every
    )
    policy = Policy("policy", trainer, stack.engine, ["policy"])
    return Pipeline(
        source, store, [policy], GRPO(), curation, Checkpoints(run, keep=2), cfg, success_threshold
    )


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_step_reads_each_finished_rollouts_spans_once(
    stack: Stack, tiny_model_dir: Path, tmp_path: Path, mode: str
) -> None:
    # Staleness (async), rows, replay and the conditional advantage all use the spans.
    cfg = CurationConfig(replay=True, conditional_coef=0.5)
    counting = CountingStore(stack.store)
    pipeline = _pipeline(
        stack, counting, tiny_model_dir, tmp_path, mode, Curation.build(cfg, 2, 1.0)
    )
    try:
        report = pipeline.run_step()
    finally:
        pipeline.source.close()
    trained = read_ledger(tmp_path)
    assert report.rows > 0 and len(trained) == 8
    assert all(counting.span_reads[rid] == 1 for rid in trained)
    assert max(counting.span_reads.values()) == 1  # nothing read twice, trained or not


def test_success_follows_the_runs_threshold(
    stack: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Regression: success was `reward >= 1.0` in the pipeline whatever was configured."""
    pipeline = _pipeline(
        stack, stack.store, tiny_model_dir, tmp_path, "sync", Curation([], 2),
        success_threshold=1.5,
    )  # fmt: skip
    report = pipeline.run_step()
    assert report.reward == 1.0 and report.success == 0.0


def test_policy_versions_point_only_at_written_checkpoints(
    stack: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Regression: a version's path was recorded before its checkpoint existed, and also
    for steps never checkpointed."""
    pipeline = _pipeline(
        stack, stack.store, tiny_model_dir, tmp_path, "sync", Curation([], 2),
        checkpoint_every=2,
    )  # fmt: skip
    pipeline.run_step()
    first = stack.store.latest_version()
    assert first is not None and first.version == 1 and first.path == ""
    pipeline.run_step()
    second = stack.store.latest_version()
    assert second is not None and second.version == 2
    assert Path(second.path).is_dir() and (Path(second.path) / "config.json").exists()


def _span_versions(store: Store) -> set[int]:
    """The policy version of every span recorded so far."""
    return {s.policy_version for r in store.rollouts() for s in store.spans(r.id)}


def test_a_resumed_run_serves_versions_no_earlier_span_carries(
    stack: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Regression: versions counted steps, so after a crash the steps past the checkpoint
    reused the numbers that spans of the lost weights carried, and an async run's staleness
    (current - span version) went negative."""
    first = _pipeline(stack, stack.store, tiny_model_dir, tmp_path, "sync", Curation([], 2),
                      checkpoint_every=2)  # fmt: skip
    for _ in range(3):  # checkpointed at step 2; step 3's weights die with the process
        first.run_step()
    first.source.batch(first.step)  # ... after sampling a batch
    lost = _span_versions(stack.store)
    assert len(lost) == 4
    first.source.close()
    again = Stack(tiny_model_dir, tmp_path / "traces.db")  # a new process on the same store
    try:
        second = _pipeline(again, again.store, tiny_model_dir, tmp_path, "sync",
                           Curation([], 2), checkpoint_every=2)  # fmt: skip
        assert second.resume() == 2
        served = again.engine.policy_version
        assert served > max(lost)  # so no staleness is negative
        assert second.policies[0].trainer.version == served  # what the async source reads
        latest = again.store.latest_version()
        assert latest is not None and latest.version == served
        assert Path(latest.path) == second.checkpoints.model_dir(2)
        for _ in range(3):  # the batches of steps 3 and 4 are in the store; 5's is sampled
            second.run_step()
        fresh = _span_versions(again.store) - lost
        assert fresh and min(fresh) > served
        assert again.engine.policy_version > max(fresh)
    finally:
        again.close()


@pytest.mark.parametrize("at_start", [True, False], ids=["start-checkpointed", "none"])
def test_a_run_resumed_before_its_first_step_checkpoint_moves_on_too(
    stack: Stack, tiny_model_dir: Path, tmp_path: Path, at_start: bool
) -> None:
    """The held-out evaluation before training checkpoints step 0 (guard.keep_best); a
    crash before the next checkpoint resumes there, or from nothing at all."""
    first = _pipeline(stack, stack.store, tiny_model_dir, tmp_path, "sync", Curation([], 2),
                      checkpoint_every=5)  # fmt: skip
    if at_start:
        first.save_checkpoint()
    first.run_step()
    first.source.batch(first.step)
    lost = _span_versions(stack.store)
    first.source.close()
    again = Stack(tiny_model_dir, tmp_path / "traces.db")
    try:
        second = _pipeline(again, again.store, tiny_model_dir, tmp_path, "sync",
                           Curation([], 2), checkpoint_every=5)  # fmt: skip
        assert second.resume() == 0
        served = again.engine.policy_version
        assert served > max(lost) and second.policies[0].trainer.version == served
        second.run_step()
        assert again.engine.policy_version > served
    finally:
        again.close()


def test_a_rollback_serves_the_restored_weights_under_a_new_version(
    stack: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Regression: restored weights were served under the collapsed weights' number."""
    from tracerl.pipeline.guards import rollback

    pipeline = _pipeline(stack, stack.store, tiny_model_dir, tmp_path, "sync", Curation([], 2))
    try:
        for _ in range(2):
            pipeline.run_step()
        pipeline.source.batch(pipeline.step)  # the collapsed weights' spans
        collapsed = _span_versions(stack.store)
        rollback(pipeline, 1, 0.5)
        served = stack.engine.policy_version
        assert served not in collapsed and served > max(collapsed)
        latest = stack.store.latest_version()
        # Its checkpoint is the rollback's own, of the restored state.
        assert latest is not None and latest.version == served
        assert Path(latest.path) == pipeline.checkpoints.model_dir(pipeline.step)
    finally:
        pipeline.source.close()


def test_each_metric_has_one_name() -> None:
    """Regression: dropped groups were logged as pipeline/ and curation/ at once."""
    from tracerl.metrics import step_values
    from tracerl.pipeline.sources import SourceStats
    from tracerl.pipeline.step import StepReport
    from tracerl.trainer.trainer import TrainMetrics

    curation = Curation.build(CurationConfig(dynamic_sampling=True), 2, 1.0)
    report = StepReport(
        step=1, reward=0.5, success=0.5, rollouts=8, rows=8, generate_s=1.0,
        train=TrainMetrics.empty(), source=SourceStats(), curation=curation.metrics(),
    )  # fmt: skip
    names = list(step_values(report))
    assert len(names) == len(set(names))
    dropped = [n for n in names if n.endswith("dropped_zero_variance")]
    assert dropped == ["curation/dropped_zero_variance"]


def test_evaluation_success_follows_the_threshold(stack: Stack) -> None:
    """Regression: EvalReport counted reward >= 1.0 as success whatever was configured."""
    from tracerl.evaluate import report
    from tracerl.types import RolloutStatus

    stack.store.add_tasks(_tasks(2))
    stack.store.enqueue(["t0", "t1"])
    for r, reward in zip(stack.store.claim("r", 2), (0.6, 0.3), strict=True):
        stack.store.finish(r.id, r.attempt, RolloutStatus.succeeded, "a", reward, None)
    rollouts = stack.store.rollouts()
    assert report(stack.store, rollouts, 1.0).success_rate == 0.0
    assert report(stack.store, rollouts, 1.0, threshold=0.5).success_rate == 0.5
