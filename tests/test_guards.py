"""Guard rails: collapse signals, the best checkpoint kept and exported, rollback, the
pre-flight check; and a run made to collapse on purpose (a far too high learning rate)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tracerl.pipeline.checkpoints import Checkpoints
from tracerl.pipeline.config import GuardConfig
from tracerl.pipeline.guards import (
    BatchStats,
    BestModel,
    CollapseDetector,
    Guards,
    RewardFunctionFailed,
    failures_with_tools,
    rollback,
)
from tracerl.pipeline.preflight import check_start
from tracerl.trainer.config import TrainerConfig
from tracerl.trainer.lead import Leader
from tracerl.trainer.trainer import Trainer
from tracerl.types import REWARD_ERROR, Rollout, RolloutStatus, Span

STEADY = BatchStats(sampled_nll=0.8, completion_tokens=20.0, calls=2.0, mixed_groups=0.5)


def _kinds(warnings: list[str]) -> set[str]:
    return {w.split(":")[0] for w in warnings}


def test_a_steady_run_raises_no_warning() -> None:
    det = CollapseDetector(GuardConfig())
    for step, reward in enumerate([0.3, 0.35, 0.4, 0.5, 0.55, 0.6, 0.58, 0.62], start=1):
        assert det.observe(step, reward, STEADY, kl=0.001) == []
    assert det.observe_eval(5, 0.6) == [] and det.observe_eval(10, 0.5) == []
    assert not det.collapsed


def test_a_sharp_reward_drop_is_a_collapse() -> None:
    det = CollapseDetector(GuardConfig())
    for step, reward in enumerate([0.6, 0.6, 0.6, 0.6], start=1):
        det.observe(step, reward, STEADY, 0.0)
    warnings = []
    for step, reward in enumerate([0.3, 0.2, 0.1], start=5):
        warnings = det.observe(step, reward, STEADY, 0.0)
    assert _kinds(warnings) == {"reward_drop"} and det.collapsed
    det.restart()  # after a rollback the collapsed rewards are forgotten
    assert det.observe(9, 0.55, STEADY, 0.0) == [] and not det.collapsed


def test_entropy_length_and_kl_signals_compare_with_the_start() -> None:
    det = CollapseDetector(GuardConfig())
    for step in range(1, 4):
        det.observe(step, 0.5, STEADY, 0.001)
    crashed = BatchStats(sampled_nll=0.1, completion_tokens=5.0, calls=2.0, mixed_groups=0.5)
    kinds = _kinds(det.observe(4, 0.5, crashed, kl=0.5))
    assert kinds == {"entropy_crash", "length_crash", "kl_spike"}
    assert not det.collapsed  # warnings only: a drop of reward or success is the collapse


def test_entropy_falling_while_the_reward_rises_is_learning_not_a_crash() -> None:
    sure = BatchStats(sampled_nll=0.02, completion_tokens=20.0, calls=2.0, mixed_groups=0.5)
    learning, stuck = CollapseDetector(GuardConfig()), CollapseDetector(GuardConfig())
    for step in range(1, 4):
        learning.observe(step, 0.3, STEADY, 0.001)
        stuck.observe(step, 0.3, STEADY, 0.001)
    for step, (reward, nll) in enumerate([(0.6, 0.5), (0.8, 0.1), (0.9, 0.02)], start=4):
        stats = sure.model_copy(update={"sampled_nll": nll})
        assert learning.observe(step, reward, stats, 0.001) == []
    for step in range(4, 8):
        warnings = stuck.observe(step, 0.32, sure, 0.001)
        assert _kinds(warnings) == {"entropy_crash"}
    # Every step warns (progress line, metrics); the log and the summary hold the onset once.
    assert stuck.onsets == ["step 4: " + warnings[0]]


def test_a_reward_that_rose_within_the_first_steps_counts_as_risen() -> None:
    # The demo's first steps (seed 0): the reward rose so fast that the median of the first
    # three (0.58) sat within reward_drop of the step-4 mean, and entropy's fall read as a
    # crash. The rise is measured from the first step, the starting policy's reward.
    det = CollapseDetector(GuardConfig())
    demo = [(0.375, 0.48), (0.578, 0.197), (0.773, 0.054), (0.891, 0.023), (0.859, 0.037)]
    for step, (reward, nll) in enumerate(demo, start=1):
        stats = STEADY.model_copy(update={"sampled_nll": nll})
        assert det.observe(step, reward, stats, 0.001) == []
    assert det.onsets == []


def test_failures_with_tools_compares_failing_calls_with_the_successes() -> None:
    assert failures_with_tools([2, 2, 1, 2], [True, False, False, True]) == 0.5
    assert failures_with_tools([2, 1], [True, True]) is None  # nothing failed


def _plateau_run(rewards: list[float], content: float) -> CollapseDetector:
    det = CollapseDetector(GuardConfig())
    for step, reward in enumerate(rewards, start=1):
        stats = STEADY.model_copy(update={"failures_with_tools": content})
        det.observe(step, reward, stats, 0.001)
    return det


# A demo started from a model that never learned to copy (--recipe.seed 1): RL taught the
# tool call by step 3, then the reward sat near 0.4 for 27 steps (held out 16% -> 46.5%).
STALLED = [0.23, 0.18, 0.42, 0.49, 0.42, 0.37, 0.41, 0.48, 0.30, 0.40, 0.33, 0.31, 0.34, 0.24]
STALLED += [0.40, 0.37, 0.53, 0.40, 0.38, 0.44, 0.40, 0.50, 0.52, 0.41, 0.60, 0.24, 0.35]


def test_a_reward_stalled_on_wrong_content_is_named_once() -> None:
    det = _plateau_run(STALLED, content=1.0)
    (onset,) = det.onsets  # one onset: the noise around the plateau is the plateau
    assert onset.startswith("step 15: content_plateau: train reward flat at 0.33")
    assert "SFT the skill further" in onset and not det.collapsed  # advice, not a collapse


def test_no_plateau_warning_when_failures_skip_the_tool_or_the_reward_rose() -> None:
    # Failures that skip the tool are a habit RL can still change: no content diagnosis.
    assert _plateau_run(STALLED, content=0.2).onsets == []
    # A reward that flattens high (the demo: ~0.95, its failures miscopies) is success.
    assert _plateau_run([0.35, 0.55, 0.75, 0.9] + [0.94, 0.96] * 13, content=1.0).onsets == []
    # A slow, steady rise is learning.
    rising = [0.2 + 0.02 * i for i in range(30)]
    assert _plateau_run(rising, content=1.0).onsets == []


def test_plateau_steps_zero_turns_the_diagnosis_off() -> None:
    det = CollapseDetector(GuardConfig(plateau_steps=0))
    for step, reward in enumerate(STALLED, start=1):
        stats = STEADY.model_copy(update={"failures_with_tools": 1.0})
        det.observe(step, reward, stats, 0.001)
    assert det.onsets == []


def test_a_held_out_drop_below_the_best_is_a_collapse() -> None:
    det = CollapseDetector(GuardConfig(success_drop=0.15))
    assert det.observe_eval(0, 0.4) == [] and det.observe_eval(5, 0.7) == []
    assert _kinds(det.observe_eval(10, 0.5)) == {"success_drop"} and det.collapsed


def test_best_model_prefers_the_earlier_on_ties_and_survives_a_restart(tmp_path: Path) -> None:
    best = BestModel(tmp_path)
    assert best.offer(0, 0.4) and best.offer(5, 0.6)
    assert not best.offer(10, 0.6) and not best.offer(15, 0.2)
    again = BestModel(tmp_path)
    assert (again.step, again.success) == (5, 0.6)
    assert again.evals == {0: 0.4, 5: 0.6, 10: 0.6, 15: 0.2}


def _rollout(i: int, task: str, reward: float, error: str | None = None) -> Rollout:
    status = RolloutStatus.failed if error else RolloutStatus.succeeded
    return Rollout(id=f"r{i}", task_id=task, status=status, reward=reward, error=error)


def _span(rollout: str, seq: int, prompt: int = 10) -> Span:
    return Span(
        id=f"{rollout}-{seq}", rollout_id=rollout, attempt=1, seq=seq, role="policy",
        policy_version=0, prompt_ids=[1] * prompt, completion_ids=[2] * 5, logprobs=[-0.5] * 5,
    )  # fmt: skip


def test_preflight_names_constant_rewards_errors_and_long_prompts() -> None:
    rollouts = [_rollout(i, f"t{i // 4}", 0.0) for i in range(6)]
    rollouts += [_rollout(6, "t1", 0.0, "KeyError"), _rollout(7, "t1", 0.0, "KeyError")]
    spans = [_span(r.id, 0, prompt=120) for r in rollouts]
    report = check_start(rollouts, spans, max_context=128, threshold=1.0)
    text = " ".join(report.warnings)
    assert report.mixed_groups == 0.0 and report.errors == 0.25
    assert "no variance" in text and "with an error" in text and "context" in text


def test_preflight_rewards_leave_out_rollouts_whose_reward_function_raised() -> None:
    raised = REWARD_ERROR + ":\nTraceback ...\nKeyError: 'x'"
    rollouts = [_rollout(0, "a", 1.0), _rollout(1, "a", 1.0)]
    rollouts += [_rollout(2, "a", 0.0).model_copy(update={"reward": None, "error": raised})]
    report = check_start(rollouts, [], max_context=128, threshold=1.0)
    assert report.mean_reward == 1.0 and report.mixed_groups == 0.0  # no reward of 0
    assert report.errors == pytest.approx(1 / 3) and report.groups == 1


def test_preflight_tells_wrong_content_from_a_skipped_tool() -> None:
    # Every rollout calls the tool (two model calls); half the answers are wrong anyway.
    rollouts = [_rollout(i, f"t{i // 4}", float(i % 2)) for i in range(8)]
    spans = [_span(r.id, seq) for r in rollouts for seq in (0, 1)]
    content = check_start(rollouts, spans, 512, 1.0)
    assert content.failures_with_tools == 1.0 and content.mixed_groups == 1.0
    assert any("wrong content" in w for w in content.warnings)
    # The failures skip the tool (one call): a habit, which RL fixes; no such warning.
    spans = [_span(r.id, seq) for r in rollouts for seq in range(1 + int(r.reward or 0))]
    habit = check_start(rollouts, spans, 512, 1.0)
    assert habit.failures_with_tools == 0.0 and habit.warnings == []


def _weights(path: Path) -> dict:
    return load_file(str(next(path.glob("*.safetensors"))))


@pytest.mark.slow
@pytest.mark.parametrize("respond", [False, True], ids=["export-best", "rollback"])
def test_a_run_collapsing_on_purpose_exports_the_best_checkpoint(
    calculator_skilled_dir: Path, tmp_path: Path, respond: bool
) -> None:
    """lr 0.05 wrecks the skilled calculator model (~94% success) in one step: the guard
    sees the held-out drop, and model/ holds the start's weights, not the collapsed ones.

    Only groups with mixed rewards move the weights, and this model's failures cling to
    tasks (a task it fails, it mostly fails 4 times in 4): about 1 group in 20 is mixed.
    With 16 tasks a step, two steps in a row went without an update, and the wreck came at
    the last step, after the last periodic evaluation, which left rollback nothing to
    answer. With 64 a step, a step without a mixed group is ~5%, and both steps before the
    last without one ~0.3%."""
    from tracerl.examples import example_file, example_module
    from tracerl.pipeline.config import TrainConfig
    from tracerl.pipeline.run import train
    from tracerl.types import Task

    make_tasks = example_module("calculator", "tasks").make_tasks
    train_tasks = [Task.model_validate(t) for t in make_tasks(128, "train", 0)]
    held_out = [Task.model_validate(t) for t in make_tasks(16, "eval", 1)]
    cfg = TrainConfig.model_validate({
        "name": "collapse", "runs": str(tmp_path), "model": str(calculator_skilled_dir),
        "agent": f"{example_file('calculator', 'agent')}:run",
        "reward": f"{example_file('calculator', 'reward')}:reward",
        "pipeline": {"steps": 3, "tasks_per_step": 64, "group_size": 4, "eval_every": 1},
        "trainer": {"lr": 5e-2, "warmup_steps": 0, "schedule": "constant"},
        "guard": {"preflight_tasks": 2, "rollback": respond},
    })  # fmt: skip
    summary = train(cfg, tasks=(train_tasks, held_out))
    run = tmp_path / "collapse"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary.evals[0] >= 0.5 and min(summary.evals.values()) <= summary.evals[0] - 0.3
    assert any("success_drop" in w for w in summary.warnings)
    assert any(m.get("guard/success_drop") == 1.0 for m in metrics)
    assert summary.model is not None and summary.model.model_step < summary.model.last_step
    # A rollback can bring the last weights back to the best one's score (or their weights).
    beaten = summary.model.model_success >= summary.model.last_success
    assert beaten if respond else summary.model.model_success > summary.model.last_success
    assert summary.success_after == summary.model.model_success
    # The best checkpoint was scored again at export, and it is what model/ holds.
    assert summary.model.best_step == summary.model.model_step
    assert summary.model.best_rescored == summary.model.model_success
    # Every evaluation (before, periodic, after) scored all 16 held-out tasks.
    assert {m["eval/size"] for m in metrics if "eval/success" in m} == {16}
    best_dir = run / "checkpoints" / f"step-{summary.model.model_step}" / "model"
    exported, last = _weights(run / "model"), _weights(run / "model-last")
    for key, value in _weights(best_dir).items():
        assert (exported[key] == value).all(), key
    assert respond or any((exported[k] != last[k]).any() for k in exported)
    if respond:
        rolled = [m for m in metrics if "guard/rollback" in m]
        assert rolled and rolled[0]["guard/lr"] == pytest.approx(2.5e-2)
        assert any("rollback:" in w for w in summary.warnings)


# ------------------------------------------------- rollback: one way to set the schedule


class _Engine:
    def __init__(self) -> None:
        self.loaded: list[int] = []

    def load_state_dict(self, state: dict, version: int) -> None:
        self.loaded.append(version)


def _pipeline(trainer: object, tmp_path: Path, step: int = 4) -> SimpleNamespace:
    """What `rollback` and `Guards` touch of a pipeline: one policy, checkpoints on disk."""
    checkpoints = Checkpoints(tmp_path / "run", keep=2)
    saved: list[int] = []
    issued = itertools.count(1)  # the store's version numbers (0 served the start)

    def publish(checkpointed: bool) -> None:
        version = next(issued)
        for policy in p.policies:
            policy.engine.load_state_dict({}, version)

    p = SimpleNamespace(
        policies=[SimpleNamespace(name="policy", trainer=trainer, engine=_Engine(), roles=[])],
        checkpoints=checkpoints, step=step, save_checkpoint=lambda: saved.append(p.step),
        saved=saved, publish=publish,
    )  # fmt: skip
    return p


def _fake_leader(loads: list[str]) -> Leader:
    """Rank 0's handle on data-parallel ranks, without a process group: it records the
    weights it is asked to load."""
    leader = Leader.__new__(Leader)
    leader.trainer = SimpleNamespace(  # type: ignore[assignment]
        version=4, load_weights=lambda d: loads.append(str(d)), engine_state_dict=dict
    )
    return leader


def test_rollback_rebuilds_the_schedule_at_its_step_with_the_lower_rate(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = TrainerConfig(lr=1e-2, bf16=False, warmup_steps=2, schedule="cosine", total_steps=8)
    trainer = Trainer(tiny_model_dir, cfg)
    best = _pipeline(trainer, tmp_path).checkpoints.model_dir(1)
    trainer.save_model(best)
    for _ in range(4):  # four optimizer steps into warmup + cosine
        trainer.optimizer.step()
        trainer.scheduler.step()
    trainer.optimizer.state[next(trainer.model.parameters())] = {"exp_avg": torch.ones(1)}
    pipeline = _pipeline(trainer, tmp_path)
    lr = rollback(pipeline, 1, 0.5)  # type: ignore[arg-type]
    # The schedule of the config, at the step it was at, from half the peak rate.
    assert trainer.scheduler.last_epoch == 4 and trainer.cfg.lr == pytest.approx(5e-3)
    assert lr == pytest.approx(5e-3 * trainer._lr_factor(4))
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(lr)
    trainer.optimizer.step()
    trainer.scheduler.step()
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(5e-3 * trainer._lr_factor(5))
    # The restored weights are served under a new version number, never the current one.
    assert pipeline.saved == [4] and pipeline.policies[0].engine.loaded == [1]


def test_a_data_parallel_run_refuses_rollback_at_the_start_never_mid_step(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tracerl.pipeline.config import TrainConfig

    run = {"model": str(tiny_model_dir), "agent": "a.py:run", "tasks": "t.jsonl"}
    TrainConfig.model_validate(run | {"cluster": {"trainer_ranks": 2}}).check()
    with pytest.raises(ValueError, match="data-parallel"):  # `tracerl train` says so first
        TrainConfig.model_validate(
            run | {"cluster": {"trainer_ranks": 2}, "guard": {"rollback": True}}
        ).check()
    loads: list[str] = []
    pipeline = _pipeline(_fake_leader(loads), tmp_path)
    with pytest.raises(ValueError, match="data-parallel"):
        Guards(GuardConfig(rollback=True), tmp_path, pipeline)  # type: ignore[arg-type]
    Guards(GuardConfig(rollback=False), tmp_path, pipeline)  # type: ignore[arg-type]
    # Called anyway, rollback refuses before any checkpoint weights are loaded.
    with pytest.raises(ValueError, match="data-parallel"):
        rollback(pipeline, 1, 0.5)  # type: ignore[arg-type]
    assert loads == [] and pipeline.policies[0].engine.loaded == []


def test_reward_function_errors_warn_then_stop_the_run_with_the_traceback(
    tmp_path: Path,
) -> None:
    from tracerl.pipeline.sources import SourceStats
    from tracerl.pipeline.step import StepReport
    from tracerl.trainer.trainer import TrainMetrics

    def report(step: int, errors: int, error: str | None) -> StepReport:
        return StepReport(
            step=step, reward=0.0, success=0.0, rollouts=4, rows=0, generate_s=0.0,
            train=TrainMetrics.empty(), curation={},
            source=SourceStats(reward_errors=errors, reward_error=error),
        )  # fmt: skip

    pipeline = SimpleNamespace(checkpoints=Checkpoints(tmp_path, keep=2), policies=[])
    guards = Guards(GuardConfig(max_reward_errors=3), tmp_path, pipeline)  # type: ignore[arg-type]
    assert guards.on_step(report(1, 0, None))["guard/reward_errors"] == 0
    trace = (
        "reward function raised:\nTraceback ...\n  File 'r.py', line 2, in reward\nKeyError: 'x'"
    )
    assert guards.on_step(report(2, 2, trace))["guard/reward_errors"] == 2
    assert any("reward_error" in w and "KeyError: 'x'" in w for w in guards.warned)
    with pytest.raises(RewardFunctionFailed, match="raised for 3 rollouts") as e:
        guards.on_step(report(3, 1, trace.replace("KeyError: 'x'", "ValueError: y")))
    assert "in reward\nValueError: y" in str(e.value)  # the latest traceback, shown whole
