"""A training run, assembled once: store + engines + gateway, source + runner, trainers,
pipeline, outputs.

`train(cfg)` evaluates the agent on held-out tasks, trains for cfg.pipeline.steps steps
through the gateway (the agent code unchanged), evaluates again, and leaves in
runs/<name>/: the resolved config, metrics.jsonl, TensorBoard events (tb/), checkpoints,
trained.jsonl (the rollouts trained on), replaced.jsonl (async: stale rollouts re-run),
the final model (model/), reward.png, pipeline.png and summary.json.

Shutdown runs in one order, whatever ends the run (the exit stack unwinds it): the source
(and the runner it owns: in-flight rollouts cancelled, nothing written after), the agent
threads, the metrics log, then the serving stack (HTTP server, engines, store).

With `cluster.address` set (and only then, when Ray is imported), Ray places the runners,
the servers of a server engine and the trainer ranks (tracerl.cluster); the rest of the run
is the same. The runner and rank actors are removed after the source closes and before the
serving stack does; the engine servers' actors as the stack closes its engines; Ray is left
last.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel
from tqdm import tqdm

from tracerl.agents import AgentFn, RewardFn, load_agent, load_callable
from tracerl.algorithms.curation import Curation
from tracerl.assets.curriculum import Curriculum
from tracerl.engines.config import EngineConfig
from tracerl.evaluate import EvalReport, evaluate, load_tasks
from tracerl.gateway.remote import RemoteModel
from tracerl.metrics import MetricsLog, Values, plot_pipeline, plot_rewards, step_values
from tracerl.pipeline.async_source import AsyncSource
from tracerl.pipeline.checkpoints import Checkpoints
from tracerl.pipeline.config import TrainConfig
from tracerl.pipeline.control import Control
from tracerl.pipeline.export import Exported, export_outputs
from tracerl.pipeline.guards import Guards
from tracerl.pipeline.preflight import PreflightReport, preflight
from tracerl.pipeline.sources import (
    Agents,
    Enqueue,
    NoBatch,
    RolloutSource,
    SyncSource,
    TaskOrder,
    plain_enqueue,
)
from tracerl.pipeline.step import Pipeline, Policy
from tracerl.roles import GatewayConfig, PolicySpec, remote_roles
from tracerl.stack import LocalStack, start_multi_stack
from tracerl.store import NotFound, Store
from tracerl.trainer.config import TrainerConfig
from tracerl.trainer.lead import Leader
from tracerl.trainer.trainer import Trainer
from tracerl.types import Task

if TYPE_CHECKING:
    from tracerl.cluster.session import Cluster
    from tracerl.engines.launch import Placement

__all__ = ["TrainSummary", "load_run_config", "make_source", "start_roles_stack", "train"]


class TrainSummary(BaseModel):
    """The before -> after of a run (runs/<name>/summary.json)."""

    success_before: float | None
    """Held-out success before training (None when skipped)."""
    success_after: float
    """Held-out success of the exported model (model/): the best held-out checkpoint with
    guard.keep_best, else the last weights."""
    steps: int
    """Training steps done in total."""
    rollouts_trained: int
    """Rollouts trained on in total."""
    wall_s: float
    """Wall time of this invocation."""
    run_dir: str
    """Where the outputs are."""
    model: Exported | None = None
    """Which weights were exported where, the best and the last, with their scores."""
    evals: dict[int, float] = {}
    """Held-out success by step (periodic evaluations use the first eval_size tasks, by
    default all)."""
    warnings: list[str] = []
    """The guard rails' warnings (pre-flight, collapse signals, rollbacks), in order."""
    preflight: PreflightReport | None = None
    """What the pre-flight groups showed (None when it was off or the run resumed)."""
    precision: str = "fp32"
    """'bf16' (autocast) or 'fp32': what `trainer.bf16` chose on this hardware."""
    precision_reason: str = ""
    """The line the run printed about it, e.g. 'precision: fp32 (CPU has AVX2 only; ...)'."""


def start_roles_stack(
    specs: list[PolicySpec],
    remote: dict[str, RemoteModel],
    store_path: str | Path,
    engine: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    gateway: GatewayConfig | None = None,
    place: Placement | None = None,
) -> LocalStack:
    """Serve every policy's roles from its own engine and the remote roles by forwarding;
    `place` puts server engines' servers (tracerl.stack.make_engine)."""
    models: dict[str, str | Path] = {p.name: p.model for p in specs}
    roles = {role: p.name for p in specs for role in p.roles}
    formats = {role: fmt for p in specs for role, fmt in p.formats.items()}
    return start_multi_stack(
        models, roles, store_path, engine, host, port, remote,
        gateway_cfg=gateway, place=place, formats=formats,
    )  # fmt: skip


def split_tasks(cfg: TrainConfig) -> tuple[list[Task], list[Task]]:
    """(train tasks, held-out tasks)."""
    train = load_tasks(cfg.tasks, "train")
    held_out = load_tasks(cfg.eval_tasks) if cfg.eval_tasks else load_tasks(cfg.tasks, "eval")
    return train, held_out


def make_source(
    cfg: TrainConfig,
    stack: LocalStack,
    agents: Agents,
    tasks: list[Task],
    curation: Curation,
    version: Callable[[], int],
    trained_roles: list[str],
    enqueue: Enqueue = plain_enqueue,
) -> RolloutSource:
    """The rollout source for cfg.pipeline.mode, queueing with `enqueue` (an asset
    curriculum's, or plainly); frozen roles never age (async)."""
    p = cfg.pipeline
    order = TaskOrder(tasks, p.tasks_per_step, p.seed)
    if p.mode == "sync":
        return SyncSource(cfg.name, stack.store, agents, order, curation, enqueue=enqueue)
    return AsyncSource(
        cfg.name, stack.store, agents, order, curation, version,
        max_staleness=p.max_staleness, window=p.window, stale=p.stale,
        trained_roles=trained_roles, journal=Path(cfg.runs) / cfg.name / "replaced.jsonl",
        enqueue=enqueue,
    )  # fmt: skip


def gateway_config(cfg: TrainConfig) -> GatewayConfig:
    """The run's gateway settings: with a distilling curriculum, its asset's calls also
    record their prompt without it (the context the rows train on)."""
    c = cfg.assets.curriculum
    if c is None or not c.distill or c.name in cfg.gateway.unassisted:
        return cfg.gateway
    return cfg.gateway.model_copy(update={"unassisted": [*cfg.gateway.unassisted, c.name]})


def make_curriculum(cfg: TrainConfig, store: Store, step: Callable[[], int]) -> Curriculum | None:
    """The run's asset curriculum (None without one), carrying the configured version or
    the current one; ValueError naming the store when the asset is not in it."""
    c = cfg.assets.curriculum
    if c is None:
        return None
    try:
        asset = store.asset(c.name, c.version)
    except NotFound as e:
        raise ValueError(
            f"assets.curriculum: {e.message} in the run's store; put it there first "
            f"(`tracerl assets put {c.name} FILE --store <the run's store>`)"
        ) from None
    return Curriculum(c, asset.version, step)


TrainerFactory = Callable[[str | Path, TrainerConfig, str], Trainer | Leader]
"""(model dir, settings, device) -> a policy's trainer."""


def _policies(cfg: TrainConfig, stack: LocalStack, make: TrainerFactory = Trainer) -> list[Policy]:
    """A trainer per trainable policy, each beside the engine that serves it."""
    t = cfg.trainer
    total = t.total_steps or cfg.pipeline.steps * t.minibatches * t.epochs
    return [
        Policy(
            spec.name,
            make(
                spec.model,
                t.model_copy(update={"lora": spec.lora, "total_steps": total}),
                cfg.device,
            ),
            stack.engines[spec.name],
            spec.roles,
        )  # fmt: skip
        for spec in cfg.policies()
        if not spec.frozen
    ]


@dataclass
class _Run:
    """A run's wired parts, as the loop uses them."""

    cfg: TrainConfig
    run_dir: Path
    stack: LocalStack
    log: MetricsLog
    agents: Agents
    source: RolloutSource
    pipeline: Pipeline
    held_out: list[Task]
    train_tasks: list[Task]
    guards: Guards
    started: float
    eval_s: float = 0.0
    extra: Callable[[], dict[str, float]] = field(default=dict)
    """More values for each step's metrics (a cluster's runner counts per node)."""
    curriculum: Curriculum | None = None
    """The asset curriculum: held-out evaluations withhold its asset."""

    def evaluate(self, tasks: list[Task], label: str) -> float:
        """Held-out success; async generation stops issuing meanwhile so the evaluation's
        pool can drain the queue, and its time is kept out of the training wall clock."""
        t0 = time.perf_counter()
        self.source.pause(True)
        try:
            report: EvalReport = evaluate(
                self.stack.store, self.agents.gateway_url, self.agents.agent,
                self.agents.reward_fn, tasks, 1, self.agents.cfg, desc=label,
                model=self.agents.model, threshold=self.cfg.success_threshold,
                assets=self.curriculum.withheld if self.curriculum else None,
            )  # fmt: skip
        finally:
            self.source.pause(False)
            self.eval_s += time.perf_counter() - t0
        return report.success_rate

    def preflight(self) -> PreflightReport:
        """The pre-flight groups on the first training tasks (PreflightError: refused)."""
        g, engine = self.cfg.guard, self.pipeline.policies[0].engine
        report = preflight(
            self.stack.store, self.agents, self.train_tasks[: g.preflight_tasks],
            self.cfg.pipeline.group_size, engine.max_context, self.cfg.success_threshold,
            max_reward_errors=g.max_reward_errors,
            assets=self.curriculum.at_start() if self.curriculum else None,
        )  # fmt: skip
        (self.run_dir / "preflight.json").write_text(report.model_dump_json(indent=2))
        self.guards.warned += [f"preflight: {w}" for w in report.warnings]
        return report


def train(
    cfg: TrainConfig,
    agent: AgentFn | None = None,
    reward_fn: RewardFn | None = None,
    tasks: tuple[list[Task], list[Task]] | None = None,
    resume: bool = False,
) -> TrainSummary:
    """Run (or resume) a training run; agent/reward/tasks may be given as objects."""
    started = time.perf_counter()
    run_dir = Path(cfg.runs) / cfg.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    train_tasks, held_out = tasks or split_tasks(cfg)
    if reward_fn is None and cfg.reward:
        reward_fn = load_callable(cfg.reward)
    with ExitStack() as exits:  # unwinds in reverse: source first, serving stack last
        specs = cfg.policies()
        store = cfg.store or run_dir / "traces.db"
        cluster: Cluster | None = None
        if cfg.cluster.address:  # Ray places runners, engine servers, ranks; imported only here
            from tracerl.cluster import session

            cluster = session.Cluster(cfg.cluster, cfg.name)
            exits.callback(cluster.close)  # last: after the stack stopped its engines' servers
        remote = remote_roles(cfg.roles, cfg.reply_format())
        stack = start_roles_stack(
            specs, remote, store, cfg.engine, cfg.cluster.gateway_host,
            gateway=gateway_config(cfg), place=cluster.engine_servers if cluster else None,
        )  # fmt: skip
        exits.callback(stack.close)
        log = MetricsLog(run_dir)
        exits.callback(log.close)
        threads = ThreadPoolExecutor(cfg.runner.concurrency, thread_name_prefix="tracerl-agent")
        exits.callback(threads.shutdown, wait=False, cancel_futures=True)
        agent = agent or load_agent(cfg.agent, threads)
        agents = Agents(stack.url, agent, reward_fn, cfg.runner, model=cfg.model_name)
        make: TrainerFactory = Trainer
        extra: Callable[[], dict[str, float]] = dict
        if cluster is not None:
            exits.callback(cluster.release)  # runners and ranks: before the stack closes
            agents = cluster.agents(agents, cfg.agent, cfg.reward or reward_fn, str(store), stack)
            make, extra = cluster.trainer, cluster.values
        policies = _policies(cfg, stack, make)
        tqdm.write(policies[0].trainer.precision.line())
        curation = Curation.build(cfg.curation, cfg.pipeline.group_size, cfg.success_threshold)
        trainer = policies[0].trainer  # every policy's version moves in step with the others
        roles = [role for p in policies for role in p.roles]
        # The schedule reads the pipeline's step (the pipeline is built just below, before
        # the source issues anything).
        curriculum = make_curriculum(cfg, stack.store, lambda: pipeline.step)
        source = make_source(
            cfg, stack, agents, train_tasks, curation, lambda: trainer.version, roles,
            curriculum.enqueue if curriculum else plain_enqueue,
        )  # fmt: skip
        exits.callback(source.close)
        checkpoints = Checkpoints(run_dir, cfg.pipeline.keep_checkpoints)
        pipeline = Pipeline(
            source, stack.store, policies, cfg.algorithm.build(), curation, checkpoints,
            cfg.pipeline, cfg.success_threshold,
        )  # fmt: skip
        guard = cfg.guard
        if cfg.curation.dynamic_sampling:
            # Its batches hold mixed groups only: their reward sits mid-way by construction,
            # a plateau that says nothing about the policy.
            guard = guard.model_copy(update={"plateau_steps": 0})
        guards = Guards(guard, run_dir, pipeline)
        run = _Run(
            cfg, run_dir, stack, log, agents, source, pipeline, held_out, train_tasks, guards,
            started,
        )  # fmt: skip
        run.extra, run.curriculum = extra, curriculum
        if resume:
            # The previous process's runners are dead: their leases will not be renewed.
            stack.store.requeue_expired(now=float("inf"))
            pipeline.resume()
        return _loop(run)


def _loop(run: _Run) -> TrainSummary:
    """Check the start, evaluate, train step by step (logging, plotting, periodic evals,
    guard rails), evaluate, export the best and the last model."""
    cfg, pipeline, guards = run.cfg, run.pipeline, run.guards
    before, checked = None, None
    if cfg.guard.preflight and pipeline.step == 0:
        checked = run.preflight()
    if cfg.eval_before and pipeline.step == 0:
        before = run.evaluate(run.held_out, "eval before")
        first: Values = {"eval/success": before, "eval/size": len(run.held_out)}
        run.log.log(0, first | guards.on_eval(0, before))
    bar = tqdm(total=cfg.pipeline.steps, initial=pipeline.step, desc="train", unit="step")
    # Live control (tracerl ctl, the dashboard): commands applied between steps.
    control = Control(run.run_dir, cfg, pipeline)
    # A batch that waits obeys control too: a pause blocks it, a stop gives it up.
    run.source.interrupt = lambda: not control.between_steps(bar)
    while pipeline.step < cfg.pipeline.steps and control.between_steps(bar):
        try:
            report = pipeline.run_step()
        except NoBatch as e:  # nothing of the step was trained: the run ends here
            if not control.stopping:
                tqdm.write(f"tracerl: {e}")
                guards.warned.append(str(e))
            break
        values = step_values(report) | guards.on_step(report)
        values["time/wall_s"] = time.perf_counter() - run.started
        values["time/train_wall_s"] = time.perf_counter() - run.started - run.eval_s
        values |= run.extra()
        if run.curriculum is not None:
            values |= run.curriculum.values()
        every = cfg.pipeline.eval_every
        if every and report.step % every == 0 and report.step < cfg.pipeline.steps:
            subset = run.held_out[: cfg.pipeline.eval_size]  # None: all of them
            success = run.evaluate(subset, f"eval step {report.step}")
            values |= {"eval/success": success, "eval/size": len(subset)}
            values |= guards.on_eval(report.step, success)
        values |= guards.respond()
        run.log.log(report.step, values | control.metrics())
        bar.update(1)
        bar.set_postfix(
            reward=f"{report.reward:.2f}",
            success=f"{report.success:.2f}",
            tok_s=f"{report.train.tokens_per_s:.0f}",
            **({"guard": guards.postfix()} if guards.postfix() else {}),
        )
        plot_rewards(run.log.path, run.run_dir / "reward.png", cfg.name)
    bar.close()
    return _finish(run, before, checked)


def _finish(run: _Run, before: float | None, checked: PreflightReport | None) -> TrainSummary:
    """The final evaluation, the plots, the exported models and summary.json."""
    cfg, pipeline = run.cfg, run.pipeline
    after = run.evaluate(run.held_out, "eval after")
    values: Values = {"eval/success": after, "eval/final": after, "eval/size": len(run.held_out)}
    run.log.log(pipeline.step, values | run.guards.on_eval(pipeline.step, after))
    plot_rewards(run.log.path, run.run_dir / "reward.png", cfg.name)
    plot_pipeline(run.log.path, run.run_dir / "pipeline.png", cfg.name)
    exported = export_outputs(
        pipeline, run.guards, run.run_dir, after, lambda label: run.evaluate(run.held_out, label)
    )
    summary = TrainSummary(
        success_before=before,
        success_after=exported.model_success,
        steps=pipeline.step,
        rollouts_trained=pipeline.rollouts_trained,
        wall_s=time.perf_counter() - run.started,
        run_dir=str(run.run_dir),
        model=exported,
        evals=run.guards.best.evals,
        warnings=run.guards.warned,
        preflight=checked,
        precision=pipeline.policies[0].trainer.precision.name,
        precision_reason=pipeline.policies[0].trainer.precision.line(),
    )
    (run.run_dir / "summary.json").write_text(summary.model_dump_json(indent=2))
    return summary


def load_run_config(run_dir: str | Path) -> TrainConfig:
    """The resolved config a run saved."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"{run_dir} is not a run directory (no config.json)")
    return TrainConfig.model_validate(json.loads(path.read_text()))
