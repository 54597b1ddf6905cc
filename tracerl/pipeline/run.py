"""A training run, assembled: store + engine + gateway, runner, trainer, pipeline, outputs.

`train(cfg)` evaluates the agent on held-out tasks, trains for cfg.pipeline.steps steps
through the gateway (the agent code unchanged), evaluates again, and leaves in
runs/<name>/: the resolved config, metrics.jsonl, TensorBoard events (tb/), checkpoints,
the final model (model/), reward.png, pipeline.png and summary.json.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import BaseModel
from tqdm import tqdm

from tracerl.algorithms.curation import Curator
from tracerl.engines.config import EngineConfig
from tracerl.evaluate import EvalReport, evaluate, load_tasks
from tracerl.gateway.remote import RemoteModel
from tracerl.metrics import MetricsLog, plot_pipeline, plot_rewards
from tracerl.pipeline.config import TrainConfig
from tracerl.pipeline.sources import AsyncSource, SyncSource
from tracerl.pipeline.step import Checkpoints, Pipeline, Policy, StepReport, make_source
from tracerl.roles import PolicySpec, remote_roles
from tracerl.runner import AgentFn, RewardFn, RunnerConfig, load_agent, load_callable
from tracerl.stack import LocalStack, start_multi_stack
from tracerl.trainer.trainer import Trainer
from tracerl.types import Task


def start_roles_stack(
    specs: list[PolicySpec],
    remote: dict[str, RemoteModel],
    store_path: str | Path,
    engine: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 0,
) -> LocalStack:
    """Serve every policy's roles from its own engine and the remote roles by forwarding."""
    models: dict[str, str | Path] = {p.name: p.model for p in specs}
    roles = {role: p.name for p in specs for role in p.roles}
    return start_multi_stack(models, roles, store_path, engine, host, port, remote=remote)


class TrainSummary(BaseModel):
    """The before -> after of a run (runs/<name>/summary.json)."""

    success_before: float | None
    """Held-out success before training (None when skipped)."""
    success_after: float
    """Held-out success after training."""
    steps: int
    """Training steps done in total."""
    rollouts_trained: int
    """Rollouts trained on in total."""
    wall_s: float
    """Wall time of this invocation."""
    run_dir: str
    """Where the outputs are."""


def split_tasks(cfg: TrainConfig) -> tuple[list[Task], list[Task]]:
    """(train tasks, held-out tasks)."""
    train = load_tasks(cfg.tasks, "train")
    held_out = load_tasks(cfg.eval_tasks) if cfg.eval_tasks else load_tasks(cfg.tasks, "eval")
    return train, held_out


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
    specs = cfg.policies()
    stack = start_roles_stack(specs, remote_roles(cfg.roles), run_dir / "traces.db", cfg.engine)
    log = MetricsLog(run_dir)
    threads = ThreadPoolExecutor(cfg.runner.concurrency)
    try:
        agent = agent or load_agent(cfg.agent, threads)
        return _run(
            cfg, run_dir, stack, log, agent, reward_fn, train_tasks, held_out, resume, started,
            specs,
        )  # fmt: skip
    finally:
        threads.shutdown(wait=False, cancel_futures=True)
        log.close()
        stack.close()


def _run(
    cfg: TrainConfig,
    run_dir: Path,
    stack: LocalStack,
    log: MetricsLog,
    agent: AgentFn,
    reward_fn: RewardFn | None,
    train_tasks: list[Task],
    held_out: list[Task],
    resume: bool,
    started: float,
    specs: list[PolicySpec],
) -> TrainSummary:
    t = cfg.trainer
    total = t.total_steps or cfg.pipeline.steps * t.minibatches * t.epochs
    policies = [
        Policy(
            spec.name,
            Trainer(
                spec.model,
                t.model_copy(update={"lora": spec.lora, "total_steps": total}),
                cfg.device,
            ),
            stack.engines[spec.name],
            spec.roles,
        )
        for spec in specs
        if not spec.frozen
    ]
    trainer = policies[0].trainer  # every policy's version moves in step with the others
    runner_cfg = cfg.runner.model_copy(update={"model": cfg.model_name})
    curator = None
    if cfg.curation.enabled:
        curator = Curator(cfg.curation, cfg.pipeline.group_size)
    source = make_source(
        cfg.name,
        stack.store,
        stack.url,
        agent,
        reward_fn,
        train_tasks,
        cfg.pipeline,
        runner_cfg,
        version=lambda: trainer.version,
        curator=curator,
        trained_roles=[role for p in policies for role in p.roles],
    )
    try:
        return _loop(
            cfg,
            run_dir,
            stack,
            log,
            agent,
            reward_fn,
            held_out,
            resume,
            started,
            policies,
            source,
            runner_cfg,
            curator,
        )
    finally:
        source.close()


def _loop(
    cfg: TrainConfig,
    run_dir: Path,
    stack: LocalStack,
    log: MetricsLog,
    agent: AgentFn,
    reward_fn: RewardFn | None,
    held_out: list[Task],
    resume: bool,
    started: float,
    policies: list[Policy],
    source: SyncSource | AsyncSource,
    runner_cfg: RunnerConfig,
    curator: Curator | None,
) -> TrainSummary:
    pipeline = Pipeline(
        source,
        stack.store,
        policies,
        cfg.algorithm.build(),
        Checkpoints(run_dir, cfg.pipeline.keep_checkpoints),
        cfg.pipeline,
        curator,
    )
    if resume:
        # The previous process's runners are dead: their leases will not be renewed.
        stack.store.requeue_expired(now=float("inf"))
        pipeline.resume()

    eval_s = 0.0

    def held_out_eval(tasks: list[Task], label: str) -> EvalReport:
        # Async generation pauses issuing while held-out tasks run, so the evaluation's
        # pool can drain the queue; its time is kept out of the training wall clock.
        nonlocal eval_s
        t0 = time.perf_counter()
        if isinstance(source, AsyncSource):
            source.pause(True)
        try:
            return evaluate(
                stack.store, stack.url, agent, reward_fn, tasks, 1, runner_cfg, desc=label
            )
        finally:
            if isinstance(source, AsyncSource):
                source.pause(False)
            eval_s += time.perf_counter() - t0

    before = None
    if cfg.eval_before and pipeline.step == 0:
        before = held_out_eval(held_out, "eval before").success_rate
        log.log(0, {"eval/success": before})
    bar = tqdm(total=cfg.pipeline.steps, initial=pipeline.step, desc="train", unit="step")
    while pipeline.step < cfg.pipeline.steps:
        report = pipeline.run_step()
        values = _step_values(report) | report.curation
        values["time/wall_s"] = time.perf_counter() - started
        values["time/train_wall_s"] = time.perf_counter() - started - eval_s
        if isinstance(source, AsyncSource):
            values["runner/utilisation"] = source.utilisation()
        every = cfg.pipeline.eval_every
        if every and report.step % every == 0 and report.step < cfg.pipeline.steps:
            values["eval/success"] = held_out_eval(
                held_out[: cfg.pipeline.eval_size], f"eval step {report.step}"
            ).success_rate
        log.log(report.step, values)
        bar.update(1)
        bar.set_postfix(
            reward=f"{report.reward:.2f}",
            success=f"{report.success:.2f}",
            tok_s=f"{report.train.tokens_per_s:.0f}",
        )
        plot_rewards(log.path, run_dir / "reward.png", cfg.name)
    bar.close()
    after = held_out_eval(held_out, "eval after").success_rate
    log.log(pipeline.step, {"eval/success": after, "eval/final": after})
    plot_rewards(log.path, run_dir / "reward.png", cfg.name)
    plot_pipeline(log.path, run_dir / "pipeline.png", cfg.name)
    if len(policies) == 1:
        _save_outputs(policies[0], stack, run_dir / "model")
    else:
        for policy in policies:
            _save_outputs(policy, stack, run_dir / "models" / policy.name)
    summary = TrainSummary(
        success_before=before,
        success_after=after,
        steps=pipeline.step,
        rollouts_trained=len(pipeline.trained),
        wall_s=time.perf_counter() - started,
        run_dir=str(run_dir),
    )
    (run_dir / "summary.json").write_text(summary.model_dump_json(indent=2))
    return summary


def _save_outputs(policy: Policy, stack: LocalStack, out: Path) -> None:
    """`out`: an HF model dir (full FT) or a peft adapter (LoRA); with LoRA also
    `<out>-merged`, a plain HF model dir any tool (or `tracerl eval`) loads directly.
    A multi-policy run writes models/<policy>/ for each trained policy."""
    tokenizer = policy.engine.tokenizer  # type: ignore[attr-defined]
    trainer = policy.trainer
    trainer.save_model(out)
    tokenizer.save_pretrained(str(out))
    if trainer.cfg.lora is None:
        return
    from transformers import AutoModelForCausalLM

    merged_dir = out.with_name(out.name + "-merged")
    merged = AutoModelForCausalLM.from_pretrained(trainer.model_dir)
    merged.load_state_dict(trainer.engine_state_dict())
    merged.save_pretrained(str(merged_dir))
    tokenizer.save_pretrained(str(merged_dir))


def _step_values(report: StepReport) -> dict[str, float | int | str | None]:
    t = report.train
    per_policy: dict[str, float | int | str | None] = {"train/frozen_rows": report.frozen_rows}
    if len(report.role_rows) > 1:
        per_policy |= {f"train/rows/{role}": n for role, n in report.role_rows.items()}
    if len(report.policies) > 1:
        for name, m in report.policies.items():
            per_policy[f"train/{name}/loss"] = m.loss if m else None
            per_policy[f"train/{name}/tokens"] = m.tokens if m else 0
            per_policy[f"train/{name}/kl_behaviour"] = m.kl_behaviour if m else None
    return per_policy | {
        "train/reward": report.reward,
        "train/success": report.success,
        "train/rollouts": report.rollouts,
        "train/rows": report.rows,
        "train/loss": t.loss,
        "train/grad_norm": t.grad_norm,
        "train/lr": t.lr,
        "train/clip_fraction": t.clip_fraction,
        "train/tis_ratio_mean": t.tis_ratio_mean,
        "train/tis_ratio_max": t.tis_ratio_max,
        "train/tis_capped_fraction": t.tis_capped_fraction,
        "train/kl_behaviour": t.kl_behaviour,
        "train/kl_reference": t.kl_reference,
        "train/is_masked_fraction": t.is_masked_fraction,
        "train/entropy_kept_fraction": t.entropy_kept_fraction,
        "train/entropy": t.entropy,
        "train/tokens": t.tokens,
        "train/tokens_per_s": t.tokens_per_s,
        "time/generate_s": report.generate_s,
        "time/train_s": t.wall_s,
        "time/trainer_idle_s": report.source.wait_s,
        "pipeline/staleness_mean": report.source.staleness_mean,
        "pipeline/staleness_max": report.source.staleness_max,
        "pipeline/stale_dropped": report.source.stale_dropped,
        "pipeline/stale_requeued": report.source.stale_requeued,
        "pipeline/dropped_zero_variance": report.source.dropped_zero_variance,
        "pipeline/pending_groups": report.source.pending_groups,
        "pipeline/rollouts_per_s": report.rollouts / max(report.generate_s + t.wall_s, 1e-9),
    }


def load_run_config(run_dir: str | Path) -> TrainConfig:
    """The resolved config a run saved."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"{run_dir} is not a run directory (no config.json)")
    return TrainConfig.model_validate(json.loads(path.read_text()))
