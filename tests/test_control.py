"""Live control of a training run: the control files' protocol, `set` replayed on resume,
and `tracerl ctl` against a real run — set the learning rate and the group size mid-run,
pause (the loop blocks), resume, stop cleanly, then resume the stopped run."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tracerl.cli import main as cli
from tracerl.examples import example_module
from tracerl.pipeline.checkpoints import read_ledger
from tracerl.pipeline.config import GuardConfig, PipelineConfig, TrainConfig
from tracerl.pipeline.control import Control
from tracerl.pipeline.control_files import (
    parse_setting,
    read_applied,
    read_commands,
    read_state,
    send,
    wait_applied,
    with_setting,
)
from tracerl.pipeline.guards import RewardFunctionFailed
from tracerl.pipeline.run import TrainSummary, train
from tracerl.store.sqlite import SqliteStore
from tracerl.trainer.config import TrainerConfig
from tracerl.trainer.lead import Leader
from tracerl.trainer.trainer import Trainer
from tracerl.types import RolloutStatus

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ the protocol, unit


def test_settings_parse_and_validate_against_the_config() -> None:
    assert parse_setting("trainer.lr=3e-4") == ("trainer.lr", 3e-4)
    assert parse_setting("curation.dynamic_sampling=true") == ("curation.dynamic_sampling", True)
    assert parse_setting("curation.secondary=tokens") == ("curation.secondary", "tokens")
    for bad in ("trainer.lr", "=3", "trainer.epochs=2", "device=cuda", "curation.nope=1"):
        with pytest.raises(ValueError):
            parse_setting(bad)
    cfg = TrainConfig()
    assert with_setting(cfg, "pipeline.group_size", 4).pipeline.group_size == 4
    with pytest.raises(ValueError, match="greater than 0"):
        with_setting(cfg, "trainer.lr", -1)
    with pytest.raises(ValueError, match="group_size_min must be <= group_size_max"):
        with_setting(cfg, "curation.group_size_min", 99)


def test_send_refuses_bad_commands_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a run directory"):
        send(tmp_path, "pause")
    (tmp_path / "config.json").write_text(TrainConfig().model_dump_json())
    with pytest.raises(ValueError):
        send(tmp_path, "set", "trainer.lr", "fast")
    with pytest.raises(ValueError, match="takes no setting"):
        send(tmp_path, "pause", "trainer.lr", 1.0)
    assert read_commands(tmp_path) == []
    cmd = send(tmp_path, "set", "trainer.lr", 0.01)
    assert [c.id for c in read_commands(tmp_path)] == [cmd.id]


class _Trainer:
    """What Control touches of a trainer: a real optimizer, and Trainer's own schedule code
    (4 warmup steps, then constant)."""

    set_lr = Trainer.set_lr
    _lr_factor = Trainer._lr_factor

    def __init__(self, lr: float) -> None:
        self.cfg = TrainerConfig(lr=lr, warmup_steps=4, schedule="constant")
        self.optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)


def _fake_pipeline(step: int, lr: float = 1e-3) -> Any:
    """What Control touches of a pipeline, with a real optimizer and schedule."""
    trainer = _Trainer(lr)
    source = SimpleNamespace(paused=[], pause=lambda p: source.paused.append(p))
    checkpoints = SimpleNamespace(latest=lambda: None)
    return SimpleNamespace(step=step, policies=[SimpleNamespace(trainer=trainer)],
                           source=source, checkpoints=checkpoints)  # fmt: skip


def test_set_lr_changes_the_base_and_keeps_the_schedules_factor() -> None:
    p = _fake_pipeline(0)
    trainer = p.policies[0].trainer
    trainer.optimizer.step()
    trainer.scheduler.step()  # step 1 of the warmup: factor 2/4
    trainer.set_lr(4e-3)
    assert trainer.scheduler.base_lrs == [4e-3] and trainer.cfg.lr == 4e-3
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3)  # x the factor
    trainer.optimizer.step()
    trainer.scheduler.step()
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(3e-3)  # factor 3/4


def test_applied_sets_are_replayed_on_resume_and_commands_never_twice(tmp_path: Path) -> None:
    cfg = TrainConfig(trainer=TrainerConfig(lr=1e-3))
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    first = Control(tmp_path, cfg, _fake_pipeline(step=0))
    send(tmp_path, "set", "trainer.lr", 5e-3)
    send(tmp_path, "pause")
    assert [c.op for c in first.poll()] == ["set", "pause"]
    assert len(first.poll()) == 2  # the same until applied
    send(tmp_path, "resume")
    assert first.between_steps() is True  # set, pause, resume: applied in order, no block
    applied = read_applied(tmp_path)
    assert [(a.op, a.ok, a.step) for a in applied] == [("set", True, 1)] + [
        ("pause", True, 1),
        ("resume", True, 1),
    ]
    assert first.metrics()["control/trainer.lr"] == 5e-3
    # A resumed run (step > 0) built from the original config gets the set back...
    resumed = _fake_pipeline(step=3)
    Control(tmp_path, cfg, resumed)
    assert resumed.policies[0].trainer.scheduler.base_lrs == [5e-3]
    assert len(read_applied(tmp_path)) == 3 and first.poll() == []  # nothing applied twice
    # A fresh run (step 0) in the same dir starts afresh: nothing replayed or re-applied.
    time.sleep(0.01)
    (tmp_path / "config.json").write_text(cfg.model_dump_json())  # as train() does first
    fresh = _fake_pipeline(step=0)
    Control(tmp_path, cfg, fresh)
    assert fresh.policies[0].trainer.scheduler.base_lrs == [1e-3]
    assert read_applied(tmp_path) == [] and (tmp_path / "control_applied.prev.jsonl").exists()
    assert read_commands(tmp_path) == []


def test_a_refused_set_is_answered_with_its_reason(tmp_path: Path) -> None:
    cfg = TrainConfig()
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    control = Control(tmp_path, cfg, _fake_pipeline(step=2))
    # Written past `send`'s check, as an older client or a hand edit might.
    line = {"id": "x1", "op": "set", "key": "pipeline.group_size", "value": 0, "at": time.time()}
    with (tmp_path / "control.jsonl").open("a") as f:
        f.write(json.dumps(line) + "\n")
    control.between_steps()
    (answer,) = read_applied(tmp_path)
    assert not answer.ok and "group_size" in (answer.error or "")


def test_a_data_parallel_run_refuses_a_learning_rate_change_when_it_arrives(
    tmp_path: Path,
) -> None:
    """Its ranks take no optimizer change mid-run: the command is answered with the reason
    (what `tracerl ctl` and the dashboard show), and the run goes on."""
    cfg = TrainConfig()
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    pipeline = _fake_pipeline(step=2)
    leader = Leader.__new__(Leader)  # rank 0's handle, without a process group
    leader.trainer = pipeline.policies[0].trainer
    pipeline.policies = [SimpleNamespace(trainer=leader)]
    pipeline.cfg = PipelineConfig()
    control = Control(tmp_path, cfg, pipeline)
    send(tmp_path, "set", "trainer.lr", 5e-3)
    send(tmp_path, "checkpoint")
    assert control.between_steps() is True
    lr, checkpoint = read_applied(tmp_path)
    assert not lr.ok and "data-parallel" in (lr.error or "")
    assert checkpoint.ok
    assert leader.trainer.scheduler.base_lrs == [1e-3]  # type: ignore[attr-defined]
    assert control.cfg.trainer.lr == cfg.trainer.lr


def test_hand_edited_bad_lines_never_stop_the_loop(tmp_path: Path) -> None:
    cfg = TrainConfig()
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    control = Control(tmp_path, cfg, _fake_pipeline(step=1))
    with (tmp_path / "control.jsonl").open("a") as f:
        f.write('{"id": "a", "op": "explode", "at": 1}\nnot json\n')
    ok = send(tmp_path, "checkpoint")
    assert [c.id for c in control.poll()] == [ok.id]


def test_ctl_refuses_bad_commands_and_queues_for_a_run_not_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(TrainConfig().model_dump_json())
    for args, says in [
        (["set", "trainer.epochs=2"], "cannot be set"),
        (["set"], "set needs key=value"),
        (["pause", "trainer.lr=1"], "takes no key=value"),
        (["set", "trainer.lr=-1"], "greater than 0"),
    ]:
        with pytest.raises(SystemExit, match=says):
            cli(["ctl", str(tmp_path), *args])
    with pytest.raises(SystemExit, match="not a run directory"):
        cli(["ctl", str(tmp_path / "nope"), "pause"])
    assert read_commands(tmp_path) == []
    cli(["ctl", str(tmp_path), "set", "trainer.lr=0.002", "--wait", "0"])
    assert "not training now" in capsys.readouterr().out
    assert [(c.key, c.value) for c in read_commands(tmp_path)] == [("trainer.lr", 0.002)]
    with pytest.raises(SystemExit, match="loopback"):
        cli(["dashboard", "--host", "0.0.0.0"])


# ------------------------------------------------------------------ a real run, end to end


@dataclass
class BackgroundRun:
    """A training run in a thread of the test process."""

    cfg: TrainConfig
    thread: threading.Thread | None = None
    summary: TrainSummary | None = None
    error: BaseException | None = None
    events: list[str] = field(default_factory=list)

    @property
    def dir(self) -> Path:
        return Path(self.cfg.runs) / self.cfg.name

    def metrics(self) -> list[dict[str, Any]]:
        path = self.dir / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def steps(self) -> list[int]:
        return [m["step"] for m in self.metrics() if "train/reward" in m]

    def wait(self, what: Callable[[], bool], timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert self.error is None, f"training failed: {self.error!r}"
            assert time.monotonic() < deadline, "timed out waiting"
            time.sleep(0.05)

    def join(self, timeout: float = 240) -> TrainSummary:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the run did not end"
        if self.error is not None:
            raise self.error
        assert self.summary is not None
        return self.summary


def run_config(
    tmp: Path, model: Path, steps: int, name: str = "live", checkpoint_every: int = 1
) -> TrainConfig:
    """A small real run: the tiny model, an agent with two calls, 2 tasks x 2 per step."""
    make_tasks = example_module("calculator", "tasks").make_tasks
    tasks = tmp / "tasks.jsonl"
    rows = make_tasks(40, "train", 0) + make_tasks(4, "eval", 1)
    tasks.write_text("".join(json.dumps(t) + "\n" for t in rows))
    return TrainConfig(
        name=name, runs=str(tmp / "runs"), model=str(model), tasks=str(tasks),
        agent=f"{ROOT}/tests/agents/slow_agent.py:run",
        reward=f"{ROOT}/examples/calculator/reward.py:reward", eval_before=False,
        pipeline=PipelineConfig(steps=steps, tasks_per_step=2, group_size=2, eval_every=0,
                                checkpoint_every=checkpoint_every),
        trainer=TrainerConfig(lr=1e-3, bf16=False),
        # A random model never answers right: the pre-flight would refuse the run.
        guard=GuardConfig(preflight=False),
    )  # fmt: skip


@contextmanager
def background_run(cfg: TrainConfig, resume: bool = False) -> Iterator[BackgroundRun]:
    """Start `train(cfg)` in a thread; on exit, stop it (if still running) and join."""
    run = BackgroundRun(cfg)

    def target() -> None:
        try:
            run.summary = train(cfg, resume=resume)
        except BaseException as e:  # handed to the test thread
            run.error = e

    run.thread = threading.Thread(target=target, name="test-train", daemon=True)
    run.thread.start()
    try:
        yield run
    finally:
        if run.thread.is_alive() and run.dir.joinpath("config.json").exists():
            send(run.dir, "stop")
        run.thread.join(240)


def ctl(*args: str) -> None:
    cli(["ctl", *args, "--wait", "60"])


@pytest.mark.slow
def test_ctl_mid_run_set_pause_resume_stop_then_resume(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLOW_AGENT_SLEEP", "0.1")
    # Checkpoints only on demand (and at the last step), so `checkpoint` writes one.
    cfg = run_config(tmp_path, tiny_model_dir, steps=8, checkpoint_every=100)
    with background_run(cfg) as run:
        run.wait(lambda: len(run.steps()) >= 1)
        ctl(str(run.dir), "set", "trainer.lr=0.003", "pipeline.group_size=3")
        applied = {a.key: a for a in read_applied(run.dir)}
        took = applied["trainer.lr"].step
        assert took >= 2 and applied["pipeline.group_size"].step == took

        ctl(str(run.dir), "pause")
        state = read_state(run.dir)
        assert state is not None and state.state == "paused"
        paused_at = run.steps()
        time.sleep(2.0)  # the loop blocks: no step while paused
        assert run.steps() == paused_at and read_state(run.dir).state == "paused"  # type: ignore[union-attr]
        ctl(str(run.dir), "checkpoint")  # answered while paused: the next step ends with one
        asked = len(paused_at) + 1
        assert read_applied(run.dir)[-1].step == asked

        ctl(str(run.dir), "resume")
        run.wait(lambda: len(run.steps()) > asked)  # one more: checkpoint_every is back to 100
        ctl(str(run.dir), "stop")
        summary = run.join()

    # The new lr from the step it took effect, the old one before; logged under control/.
    by_step = {m["step"]: m for m in run.metrics() if "train/lr" in m}
    assert all(by_step[s]["train/lr"] == pytest.approx(1e-3) for s in by_step if s < took)
    assert all(by_step[s]["train/lr"] == pytest.approx(3e-3) for s in by_step if s >= took)
    assert by_step[took]["control/trainer.lr"] == 3e-3
    assert by_step[took]["control/pipeline.group_size"] == 3
    assert by_step[asked]["control/checkpoint"] == asked
    assert by_step[asked]["control/paused_s"] >= 2.0
    # The asked-for checkpoint exists though checkpoint_every is 100 (the guard rails may keep
    # the last step's too, for the export).
    kept = {int(p.name.split("-")[1]) for p in (run.dir / "checkpoints").glob("step-*")}
    assert asked in kept
    # Groups issued from that step on have 3 rollouts.
    sizes = group_sizes(run.dir)
    assert {n for step, n in sizes if step < took} == {2}
    assert {n for step, n in sizes if step >= took} == {3}
    # Stopped cleanly after the step in progress: final evaluation and export.
    assert asked < summary.steps < 8 and summary.steps == max(run.steps())
    assert (run.dir / "model" / "config.json").exists() and (run.dir / "summary.json").exists()
    assert read_state(run.dir).state == "stopping"  # type: ignore[union-attr]

    # Resumed (from its own config, lr 1e-3) at the checkpoint: the sets are kept, and the
    # steps after the checkpoint are trained again on the same groups, none twice.
    with background_run(cfg, resume=True) as resumed:
        final = resumed.join()
    assert final.steps == 8 and len(read_ledger(run.dir)) == len(set(read_ledger(run.dir)))
    after = [m for m in resumed.metrics() if "train/lr" in m][len(by_step) :]
    assert [m["step"] for m in after] == list(range(max(kept) + 1, 9))
    assert all(m["train/lr"] == pytest.approx(3e-3) for m in after)
    assert {n for step, n in group_sizes(run.dir) if step > asked} == {3}


@pytest.mark.slow
def test_an_async_run_with_a_constant_reward_and_dynamic_sampling_stops_with_a_message(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Regression: every group has equal reward (the random tiny model never answers right),
    so dynamic sampling drops them all, and the async batch waited forever."""
    cfg = run_config(tmp_path, tiny_model_dir, steps=3, name="flat")
    cfg = cfg.model_copy(
        update={
            "pipeline": cfg.pipeline.model_copy(update={"mode": "async"}),
            "curation": cfg.curation.model_copy(update={"dynamic_sampling": True}),
        }
    )
    with background_run(cfg) as run:
        summary = run.join(timeout=180)
    (message,) = [w for w in summary.warnings if "no group to train on" in w]
    assert message.startswith("step 1:") and "same reward" in message
    assert summary.steps == 0 and summary.rollouts_trained == 0
    assert (run.dir / "summary.json").exists()  # ended as a run does: evaluated, exported


@pytest.mark.slow
def test_pause_and_stop_are_obeyed_while_an_async_batch_waits(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: control was read between steps only, so a batch that waits (here on
    agents that sleep 20 s) held a pause or a stop until it was done."""
    monkeypatch.setenv("SLOW_AGENT_SLEEP", "20")
    cfg = run_config(tmp_path, tiny_model_dir, steps=3, name="waiting")
    cfg = cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(update={"mode": "async"})})
    with background_run(cfg) as run:
        run.wait(lambda: (read_state(run.dir) or SimpleNamespace(state="")).state == "running")
        store = SqliteStore(run.dir / "traces.db")
        run.wait(lambda: bool(store.rollouts(status=RolloutStatus.running)))
        store.close()
        pause = send(run.dir, "pause")
        answer = wait_applied(run.dir, pause.id, 10)
        assert answer is not None and answer.ok, "the pause waited for the batch"
        assert answer.step == 1 and read_state(run.dir).state == "paused"  # type: ignore[union-attr]
        stop = send(run.dir, "stop")
        assert wait_applied(run.dir, stop.id, 10) is not None, "the stop waited for the batch"
        summary = run.join(timeout=120)
    assert summary.steps == 0 and run.steps() == []  # the waiting step was given up


def _broken_reward(task: dict, answer: str) -> float:
    """A reward function with a bug."""
    raise ValueError(f"cannot parse {answer!r}")


@pytest.mark.slow
@pytest.mark.parametrize("preflight", [False, True], ids=["training", "preflight"])
def test_a_crashing_reward_function_stops_the_run_with_its_traceback(
    tiny_model_dir: Path, tmp_path: Path, preflight: bool
) -> None:
    """Stopped at the first step's batch, or by the pre-flight check (which said "the
    reward was 0 on all rollouts")."""
    cfg = run_config(tmp_path, tiny_model_dir, steps=3, name="broken")
    guard = GuardConfig(preflight=preflight, preflight_tasks=2)
    with pytest.raises(RewardFunctionFailed) as e:
        train(cfg.model_copy(update={"guard": guard}), reward_fn=_broken_reward)
    message = str(e.value)
    assert "raised for 4 rollouts" in message  # 2 tasks x 2, a step's or the pre-flight's
    assert "in _broken_reward" in message and "ValueError: cannot parse" in message
    # Each is kept in the store, marked: no outcome, so never trained on as a reward of 0.
    store = SqliteStore(Path(cfg.runs) / cfg.name / "traces.db")
    rollouts = store.rollouts()
    store.close()
    assert len(rollouts) == 4 and all(r.reward_failed and not r.has_outcome for r in rollouts)


def group_sizes(run_dir: Path) -> list[tuple[int, int]]:
    """(logged step, rollouts) of each training group (a sync group id holds its step's
    index, the logged step - 1)."""
    store = SqliteStore(run_dir / "traces.db")
    sizes: dict[str, int] = {}
    for r in store.rollouts():
        if r.group_id and "/step" in r.group_id:
            sizes[r.group_id] = sizes.get(r.group_id, 0) + 1
    store.close()
    return [(int(g.split("/step")[1].split("/")[0]) + 1, n) for g, n in sizes.items()]
