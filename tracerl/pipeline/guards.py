"""Guard rails of a training run: the best held-out checkpoint, collapse detection, rollback.

RL from a weak start can make a model worse, and the last step of a run is not its best.
Three guards, each on by default (rollback excepted) and each logged under `guard/`:

- `BestModel` remembers the held-out success of every evaluation (before training,
  periodic, final) and pins the checkpoint of the best one, so pruning never deletes it;
  the run then exports it as `model/`, with the last weights beside it as `model-last/`.
- `CollapseDetector` watches each step for the signs of a collapsing policy: a sharp drop
  of the train reward or of held-out success below their best, an entropy crash while the
  reward has not risen, the KL to the behaviour policy spiking, sequence lengths
  collapsing. Each is a warning (the progress line, the log, metrics); the drops are
  "collapse" signals. One more is no collapse but a dead end: a reward that stopped
  rising well short of success while the failures use the tools like the successes
  (content_plateau: the start lacks the skill, which the pre-flight cannot see while a
  habit of skipping the tool hides it).
- `rollback` answers a collapse signal when `guard.rollback` is on: the best checkpoint's
  weights come back, the optimizer's moments are cleared (they point the way that
  collapsed), and the learning rate is multiplied by `guard.lr_factor`.

One more stops the run rather than warns: a reward function that raised (a bug in the
user's reward code; such rollouts are never trained on) `guard.max_reward_errors` times ends
the run with `RewardFunctionFailed`, which shows the latest traceback.

`BatchStats` is what the detector reads of a batch; the pipeline computes it once per step
from the groups it trained on. Entropy is estimated without an extra forward pass: the mean
negative log-probability of the sampled tokens under the policy that sampled them is an
unbiased estimate of the policy's entropy at the sampling temperature.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from tracerl.metrics import Values
from tracerl.pipeline.config import GuardConfig
from tracerl.types import Group

if TYPE_CHECKING:
    from tracerl.pipeline.step import Pipeline, StepReport

__all__ = [
    "BatchStats",
    "BestModel",
    "CollapseDetector",
    "Guards",
    "RewardFunctionFailed",
    "batch_stats",
    "failures_with_tools",
    "load_checkpoint_weights",
    "rollback",
]

log = logging.getLogger("tracerl.guard")

# content_plateau: a rise this small over plateau_steps is no rise; a reward this high is
# success enough that its failures being content is no news; and this share of failures
# using the tools like the successes (the pre-flight's line) says the content is wrong.
PLATEAU_RISE = 0.05
PLATEAU_BELOW = 0.8
CONTENT_SHARE = 0.6


class BatchStats(BaseModel):
    """What the guards read of one step's batch (the groups trained on)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    mixed_groups: float = 0.0
    """Share of groups whose rollouts did not all get the same reward (the groups that
    carry a learning signal)."""
    errors: float = 0.0
    """Share of rollouts failing with an error or ending without an outcome (the agent
    raised, timed out, leases expired)."""
    sampled_nll: float | None = None
    """Mean -log-prob of the sampled tokens under the behaviour policy: an estimate of the
    policy's entropy per token (None when nothing was sampled)."""
    completion_tokens: float = 0.0
    """Sampled tokens per rollout."""
    calls: float = 0.0
    """Model calls per rollout."""
    failures_with_tools: float | None = None
    """Among failing rollouts, the share that made at least as many model calls as the
    successful ones do on average (`failures_with_tools`); None without both."""


def failures_with_tools(calls: list[int], succeeded: list[bool]) -> float | None:
    """Among failing rollouts, the share that made at least as many model calls as the
    successful ones do on average: wrong content rather than a skipped tool. None when
    there are no successes or no failures to compare."""
    won = [c for c, ok in zip(calls, succeeded, strict=True) if ok]
    lost = [c for c, ok in zip(calls, succeeded, strict=True) if not ok]
    if not won or not lost:
        return None
    typical = statistics.fmean(won)
    return sum(c >= typical for c in lost) / len(lost)


def batch_stats(groups: list[Group], threshold: float = 1.0) -> BatchStats:
    """The guards' view of a batch (`threshold`: the reward that counts as success)."""
    rollouts = [f for g in groups for f in g.rollouts]
    if not rollouts:
        return BatchStats()
    spans = [s for f in rollouts for s in f.spans]
    logprobs = [lp for s in spans for lp in s.logprobs]
    mixed = sum(len({f.reward for f in g.with_outcome()}) > 1 for g in groups)
    return BatchStats(
        mixed_groups=mixed / max(len(groups), 1),
        errors=sum(f.rollout.error is not None or not f.has_outcome for f in rollouts)
        / len(rollouts),
        sampled_nll=-statistics.fmean(logprobs) if logprobs else None,
        completion_tokens=sum(len(s.completion_ids) for s in spans) / len(rollouts),
        calls=len(spans) / len(rollouts),
        failures_with_tools=failures_with_tools(
            [len(f.spans) for f in rollouts], [f.success(threshold) for f in rollouts]
        ),
    )


@dataclass
class CollapseDetector:
    """Turns each step's numbers into warnings; `collapsed` says whether one was a drop.

    Baselines are the run's own: the best rolling mean of the train reward, the best
    held-out success, the median of the first steps' entropy, KL and lengths, and the first
    step's reward (the starting policy's: a fast learner's reward has already risen by the
    third step, so a median of the first three would hide the rise).
    Warnings repeat on every step the condition holds; the log line is written once per
    kind until the condition clears, so a log stays readable (`onsets` holds those).

    Entropy falling is what learning a task looks like once the policy is sure of it: the
    demo's entropy falls ~10x while held-out success goes 32% -> 88%. It is a crash (the
    policy stopped exploring before it found anything) only while the train reward has not
    risen `reward_drop` above where it started.
    """

    cfg: GuardConfig
    _rewards: deque[float] = field(default_factory=deque)
    _best_reward: float | None = None
    _start_reward: float | None = None
    _means: list[float] = field(default_factory=list)
    """The train reward's rolling mean after each step whose window was full."""
    _content: deque[float] = field(default_factory=deque)
    _plateau: float | None = None
    _best_success: float | None = None
    _early: dict[str, list[float]] = field(default_factory=dict)
    _active: set[str] = field(default_factory=set)
    collapsed: bool = False
    """Whether the last observed step raised a drop (the signal rollback answers)."""
    onsets: list[str] = field(default_factory=list)
    """Each warning as it first appeared (again after its condition cleared), with its
    step: what the log shows and the run's summary lists."""

    def __post_init__(self) -> None:
        # Both windows hold the last `window` steps; a full deque drops its oldest itself.
        self._rewards = deque(maxlen=self.cfg.window)
        self._content = deque(maxlen=self.cfg.window)

    def observe(self, step: int, reward: float, stats: BatchStats, kl: float) -> list[str]:
        """A step's warnings: the train reward, entropy, KL and length signals."""
        if self._start_reward is None:
            self._start_reward = reward
        warnings = [self._reward_drop(reward)]
        rose = bool(self._means) and self._means[-1] - self._start_reward >= self.cfg.reward_drop
        warnings += [
            None if rose else self._fell("entropy", stats.sampled_nll, self.cfg.entropy_ratio),
            self._fell("length", stats.completion_tokens, self.cfg.length_ratio),
            self._kl_spike(kl),
            self._content_plateau(stats.failures_with_tools),
        ]
        return self._report(step, [w for w in warnings if w])

    def observe_eval(self, step: int, success: float) -> list[str]:
        """A held-out evaluation's warning: success fell below its best."""
        warning = None
        best = self._best_success
        if best is not None and best - success >= self.cfg.success_drop:
            warning = f"success_drop: held-out success {best:.2f} -> {success:.2f}"
        self._best_success = success if best is None else max(best, success)
        return self._report(step, [warning] if warning else [], evaluation=True)

    def restart(self) -> None:
        """Forget the recent rewards after a rollback (they belong to the collapsed
        weights), keeping the bests to compare with."""
        self._rewards.clear()
        self._means.clear()
        self._plateau = None
        self.collapsed = False

    def _reward_drop(self, reward: float) -> str | None:
        self._rewards.append(reward)
        if len(self._rewards) < self.cfg.window:
            return None
        now = statistics.fmean(self._rewards)
        self._means.append(now)
        best = self._best_reward
        self._best_reward = now if best is None else max(best, now)
        if best is not None and best - now >= self.cfg.reward_drop:
            return f"reward_drop: train reward (mean of {self.cfg.window}) {best:.2f} -> {now:.2f}"
        return None

    def _baseline(self, kind: str, value: float) -> float | None:
        """The median of the first `window` values of `kind`; None while they are gathered."""
        early = self._early.setdefault(kind, [])
        if len(early) < self.cfg.window:
            early.append(value)
            return None
        return statistics.median(early)

    def _fell(self, kind: str, value: float | None, ratio: float) -> str | None:
        if value is None:
            return None
        base = self._baseline(kind, value)
        if base is None or base <= 0 or value >= ratio * base:
            return None
        return f"{kind}_crash: {kind} {base:.3g} -> {value:.3g} (below {ratio:g}x the start)"

    def _content_plateau(self, content: float | None) -> str | None:
        """The reward stalled short of success with failures that use the tools: RL has
        taught the habits it can, and what is left is a skill the start lacks. Once seen it
        holds until the reward rises past the plateau (noise around it is the plateau)."""
        if content is not None:
            self._content.append(content)
        k = self.cfg.plateau_steps
        if not k or len(self._means) <= k or not self._content:
            return None
        now, wrong = self._means[-1], statistics.fmean(self._content)
        if self._plateau is None:
            before = max(self._means[:-k])
            stalled = max(self._means[-k:]) - before < PLATEAU_RISE
            if not (stalled and now < PLATEAU_BELOW and wrong >= CONTENT_SHARE):
                return None
            self._plateau = before
        elif max(self._means) - self._plateau >= PLATEAU_RISE:
            self._plateau = None
            return None
        return (
            f"content_plateau: train reward flat at {now:.2f} for {k}+ steps and {wrong:.0%} "
            "of failing rollouts made as many model calls as the successful ones: the "
            "failures are wrong content, which RL fixes slowly (docs/recipes.md: SFT the "
            "skill further)"
        )

    def _kl_spike(self, kl: float) -> str | None:
        base = self._baseline("kl", abs(kl))
        limit = max(self.cfg.kl_floor, self.cfg.kl_ratio * (base or 0.0))
        if base is None or kl <= limit:
            return None
        return f"kl_spike: KL to the behaviour policy {kl:.3g} (> {limit:.3g})"

    def _report(self, step: int, warnings: list[str], evaluation: bool = False) -> list[str]:
        drops = ("reward_drop", "success_drop")
        kinds = {w.split(":")[0] for w in warnings}
        if not evaluation:
            self.collapsed = bool(kinds & set(drops))
            scope = {"reward_drop", "entropy_crash", "length_crash", "kl_spike", "content_plateau"}
        else:
            self.collapsed = self.collapsed or bool(kinds & set(drops))
            scope = {"success_drop"}
        for w in warnings:
            if w.split(":")[0] not in self._active:
                log.warning("step %d: guard: %s", step, w)
                self.onsets.append(f"step {step}: {w}")
        self._active = (self._active - scope) | kinds
        return warnings


class BestModel:
    """The best held-out evaluation so far and its pinned checkpoint, kept in guard.json
    beside the checkpoints so a resumed run remembers it."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "guard.json"
        self.step: int | None = None
        self.success: float | None = None
        self.evals: dict[int, float] = {}
        if self.path.exists():
            saved = json.loads(self.path.read_text())
            self.step, self.success = saved["best_step"], saved["best_success"]
            self.evals = {int(k): v for k, v in saved["evals"].items()}

    def offer(self, step: int, success: float) -> bool:
        """Record an evaluation of the weights after `step` steps; True when it is the new
        best (ties keep the earlier: a later checkpoint must beat it, not match it)."""
        self.evals[step] = success
        better = self.success is None or success > self.success
        if better:
            self.step, self.success = step, success
        self.path.write_text(
            json.dumps({"best_step": self.step, "best_success": self.success, "evals": self.evals})
        )
        return better


def load_checkpoint_weights(pipeline: Pipeline, step: int) -> None:
    """Load step `step`'s checkpointed weights into every trainer and serve them under a new
    version number (the current one is the replaced weights')."""
    several = len(pipeline.policies) > 1
    for p in pipeline.policies:
        p.trainer.load_weights(pipeline.checkpoints.model_dir(step, p.name if several else None))
    pipeline.publish(checkpointed=False)


def rollback(pipeline: Pipeline, best_step: int, lr_factor: float) -> float:
    """Load the checkpoint of `best_step` into every trainer and engine, clear the
    optimizers' moments and scale their learning rate by `lr_factor`; returns the new lr.

    The weights are served under a new version number, and a checkpoint of the restored
    state replaces the collapsed one as the latest (and is recorded as that version's)."""
    from tracerl.pipeline.step import local_trainer  # step imports this module

    # Every trainer first: a run that cannot roll back refuses before any weight moves.
    trainers = [local_trainer(p, "a rollback") for p in pipeline.policies]
    load_checkpoint_weights(pipeline, best_step)
    lr = 0.0
    for trainer in trainers:
        trainer.optimizer.state.clear()  # Adam's moments remember the direction that collapsed
        trainer.set_lr(float(trainer.scheduler.base_lrs[0]) * lr_factor)
        lr = float(trainer.optimizer.param_groups[0]["lr"])
    pipeline.save_checkpoint()
    log.warning("step %d: guard: rolled back to step %d, lr -> %.3g", pipeline.step, best_step, lr)
    return lr


class RewardFunctionFailed(RuntimeError):
    """The reward function raised for `guard.max_reward_errors` rollouts: the run stops."""

    def __init__(self, count: int, latest: str) -> None:
        super().__init__(
            f"the reward function raised for {count} rollouts (guard.max_reward_errors); "
            f"the run stops. The latest:\n{latest}"
        )


class Guards:
    """The guard rails as the training loop calls them: after each step, after each
    held-out evaluation; each call returns the metrics to log (under guard/)."""

    def __init__(self, cfg: GuardConfig, run_dir: Path, pipeline: Pipeline) -> None:
        self.cfg, self.pipeline = cfg, pipeline
        self.detector = CollapseDetector(cfg)
        self.best = BestModel(run_dir)
        if cfg.rollback:  # refused now, when the run starts, rather than at a collapse
            from tracerl.pipeline.step import local_trainer  # step imports this module

            for p in pipeline.policies:
                local_trainer(p, "guard.rollback")
        self.rollbacks = 0
        self.reward_errors = 0
        """Rollouts of this run (this process) whose reward function raised."""
        self.last: list[str] = []
        """The warnings of the latest step and evaluation."""
        self.warned: list[str] = []
        """The run's warnings in order, each once per onset (summary.json lists them)."""
        if self.best.step is not None:
            pipeline.checkpoints.pinned = {self.best.step}

    def on_step(self, report: StepReport) -> Values:
        """Watch a step; warnings go to the log and `self.last`. RewardFunctionFailed once
        the run's reward function raised `max_reward_errors` times."""
        b = report.batch
        seen = len(self.detector.onsets)
        self.last = self.detector.observe(report.step, report.reward, b, report.train.kl_behaviour)
        self.warned += self.detector.onsets[seen:]
        self._reward_errors(report)
        values: Values = {
            "guard/entropy": b.sampled_nll,
            "guard/completion_tokens": b.completion_tokens,
            "guard/calls": b.calls,
            "guard/mixed_groups": b.mixed_groups,
            "guard/errors": b.errors,
            "guard/failures_with_tools": b.failures_with_tools,
            "guard/reward_errors": self.reward_errors,
        }
        return values | {f"guard/{w.split(':')[0]}": 1.0 for w in self.last}

    def _reward_errors(self, report: StepReport) -> None:
        """Count the batch's rollouts whose reward function raised; warn, or stop the run."""
        src = report.source
        if not src.reward_errors:
            return
        self.reward_errors += src.reward_errors
        if self.reward_errors >= self.cfg.max_reward_errors:
            raise RewardFunctionFailed(self.reward_errors, src.reward_error or "")
        first = (src.reward_error or "").strip().splitlines()[-1:]
        warning = (
            f"reward_error: the reward function raised for {src.reward_errors} rollouts "
            f"({self.reward_errors} in the run; it stops at {self.cfg.max_reward_errors}): "
            f"{''.join(first)}"
        )
        log.warning("step %d: guard: %s", report.step, warning)
        self.last.append(warning)
        self.warned.append(f"step {report.step}: {warning}")

    def on_eval(self, step: int, success: float) -> Values:
        """Record a held-out evaluation of the weights after `step` steps: pin its
        checkpoint when it is the best so far, and watch for a drop."""
        seen = len(self.detector.onsets)
        warnings = self.detector.observe_eval(step, success)
        self.warned += self.detector.onsets[seen:]
        self.last = self.last + warnings
        if self.cfg.keep_best and self.best.offer(step, success):
            if not self.pipeline.checkpoints.exists(step):
                self.pipeline.save_checkpoint()
            self.pipeline.checkpoints.pin(step)
        values: Values = {f"guard/{w.split(':')[0]}": 1.0 for w in warnings}
        return values | {"guard/best_success": self.best.success}

    def respond(self) -> Values:
        """Roll back when a drop was seen, rollback is on, and a better checkpoint exists."""
        best = self.best.step
        if not (self.cfg.rollback and self.detector.collapsed and best is not None):
            return {}
        if best >= self.pipeline.step or self.rollbacks >= self.cfg.max_rollbacks:
            return {}
        self.rollbacks += 1
        lr = rollback(self.pipeline, best, self.cfg.lr_factor)
        self.detector.restart()
        self.warned.append(f"step {self.pipeline.step}: rollback: to step {best}, lr {lr:.3g}")
        return {"guard/rollback": float(best), "guard/lr": lr}

    def postfix(self) -> str:
        """The current warnings' kinds, for the progress line ('' when none)."""
        return ",".join(dict.fromkeys(w.split(":")[0] for w in self.last))
