"""The `tracerl` command: one typed config per entry point, the CLI generated from it.

Every field of every command is documented and settable as --field (nested ones as
--section.field); `tracerl <command> --help` lists them. Each run saves its resolved
config next to its outputs.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, CliApp, CliPositionalArg, CliSubCommand
from rich.console import Console

from tracerl.algorithms.config import AlgorithmConfig, CurationConfig
from tracerl.demo import CalculatorRecipe
from tracerl.engines.config import EngineConfig
from tracerl.pipeline.config import PipelineConfig, TrainConfig
from tracerl.pipeline.run import start_roles_stack
from tracerl.roles import (
    PolicySpec,
    RoleConfig,
    check_local_models,
    remote_roles,
    resolve_roles,
    top_model,
)
from tracerl.runner import RewardFn, RunnerConfig, load_agent, load_callable
from tracerl.trainer.config import TrainerConfig


# Demo defaults, tuned so the weak tiny model learns the calculator task in minutes on CPU.
class DemoPipeline(PipelineConfig):
    """The demo's scheduling (a flag overrides one field and keeps these defaults)."""

    steps: int = Field(default=30, ge=1)
    """Training steps (policy versions published)."""
    eval_every: int = Field(default=10, ge=0)
    """Held-out evaluation every this many steps (0: only before and after)."""


class DemoTrainer(TrainerConfig):
    """The demo's policy update: lr 3e-4 with warmup, cosine decay over the run."""

    lr: float = 3e-4
    """Peak learning rate (AdamW)."""
    minibatches: int = Field(default=2, ge=1)
    """Optimizer steps per batch of rows."""
    warmup_steps: int = Field(default=5, ge=0)
    """Optimizer steps of linear warmup."""
    schedule: Literal["constant", "cosine"] = "cosine"
    """Cosine decay to 10% over the run: the end of the run settles instead of drifting."""


console = Console()
LATEST = Path("runs") / ".latest_store"


class _Cmd(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")


def _run_dir(root: str, name: str) -> Path:
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _save_config(run_dir: Path, cmd: BaseModel) -> None:
    (run_dir / "config.json").write_text(cmd.model_dump_json(indent=2))


def _remember_store(path: Path) -> None:
    LATEST.parent.mkdir(parents=True, exist_ok=True)
    LATEST.write_text(str(path.resolve()))


def _reward_fn(spec: str | None) -> RewardFn | None:
    return load_callable(spec) if spec else None


class Demo(_Cmd):
    """Build (or reuse) the weak tiny calculator model, evaluate the calculator agent on
    held-out tasks, train it with RL through the gateway (the agent code unchanged), and
    evaluate again."""

    name: str = "demo"
    """Run name: outputs go to <runs>/<name>/."""
    runs: str = "runs"
    """Folder holding runs."""
    train_tasks: int = Field(default=2000, ge=1)
    """Training tasks generated."""
    eval_tasks: int = Field(default=200, ge=1)
    """Held-out tasks to evaluate on."""
    recipe: CalculatorRecipe = CalculatorRecipe()
    """How the weak tiny model is built (skill SFT, then a lazy-answer bias)."""
    rebuild: bool = False
    """Rebuild the tiny model even if it is cached."""
    run_async: bool = Field(default=False, alias="async")
    """Generate while training (pipeline.mode async, max_staleness as configured)."""
    pipeline: DemoPipeline = DemoPipeline()
    """Scheduling."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Credit assignment."""
    curation: CurationConfig = CurationConfig(dynamic_sampling=True)
    """Data curation. The demo drops groups whose rollouts all got the same reward and tops
    up with fresh tasks (DAPO): once most answers are right, the remaining copy mistakes are
    rare, and only mixed groups carry a signal about them."""
    trainer: DemoTrainer = DemoTrainer()
    """Policy update."""
    runner: RunnerConfig = RunnerConfig(concurrency=64)
    """How rollouts are run."""
    engine: EngineConfig = EngineConfig(max_batch_size=64)
    """How the model is served."""
    device: str = "cpu"
    """torch device of the trainer and (unless engine.device is given) the engine."""

    def cli_cmd(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from tracerl.demo import ensure_calculator_model, example_module
        from tracerl.pipeline.run import train
        from tracerl.runner import python_agent
        from tracerl.types import Task

        started = time.perf_counter()
        console.print(f"[bold]tracerl demo[/bold]: calculator agent, tiny model, {self.device}")
        model_dir = ensure_calculator_model(self.recipe, self.rebuild)
        console.print(f"model: {model_dir} (ready in {time.perf_counter() - started:.0f} s)")
        tasks_mod = example_module("calculator", "tasks")
        train_tasks = [
            Task.model_validate(t) for t in tasks_mod.make_tasks(self.train_tasks, "train", 0)
        ]
        held_out = [
            Task.model_validate(t) for t in tasks_mod.make_tasks(self.eval_tasks, "eval", 1)
        ]
        agent_mod = example_module("calculator", "agent")
        reward_mod = example_module("calculator", "reward")
        cfg = TrainConfig(
            name=self.name,
            runs=self.runs,
            model=str(model_dir),
            agent="examples/calculator/agent.py:run",
            reward="examples/calculator/reward.py:reward",
            pipeline=self.pipeline.model_copy(update={"mode": "async"})
            if self.run_async
            else self.pipeline,
            algorithm=self.algorithm,
            curation=self.curation,
            trainer=self.trainer,
            runner=self.runner,
            engine=self.engine,
            device=self.device,
        )
        _remember_store(Path(self.runs) / self.name / "traces.db")
        with ThreadPoolExecutor(self.runner.concurrency) as threads:
            agent = python_agent(agent_mod.run, threads)
            summary = train(cfg, agent, reward_mod.reward, (train_tasks, held_out))
        wall = time.perf_counter() - started
        before = summary.success_before or 0.0
        console.print(
            f"[bold green]held-out success {before:.1%} -> {summary.success_after:.1%}[/bold green]"
            f" in {wall / 60:.1f} min ({summary.steps} steps, {summary.rollouts_trained} "
            f"rollouts trained) · outputs: {summary.run_dir}/ (reward.png, pipeline.png, "
            "metrics.jsonl, tb/, model/, summary.json, traces.db)"
        )


class Eval(_Cmd):
    """Run N rollouts of any agent through the gateway and report success and traces."""

    agent: CliPositionalArg[str]
    """The agent: 'file.py:function', 'module:function', or 'cmd:<command line>'."""
    tasks: str
    """Task file (JSONL: one {"id", "input", "answer", "split"} per line)."""
    model: str = ""
    """Local HF model directory to serve (the default of every role without its own)."""
    roles: dict[str, RoleConfig] = {}
    """Agent systems with several roles: each role's model dir, shared weights or url,
    as in `tracerl train` (JSON, e.g. '{"planner": {"model": "m/p"}, "executor": {...}}')."""
    reward: str | None = None
    """Reward function 'file.py:function' called as f(task, answer); optional when the
    agent returns or emits its own reward."""
    split: str | None = None
    """Only tasks of this split (default: all)."""
    repeats: int = Field(default=1, ge=1)
    """Rollouts per task."""
    model_name: str = "policy"
    """The model name the agent is told to use; with `--roles`, default: the first role."""
    name: str = "eval"
    """Run name: outputs go to <runs>/<name>/."""
    runs: str = "runs"
    """Folder holding runs."""
    runner: RunnerConfig = RunnerConfig()
    """How rollouts are run."""
    engine: EngineConfig = EngineConfig()
    """How the model is served."""

    def cli_cmd(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from tracerl.evaluate import evaluate, load_tasks

        try:
            top = top_model(self.model_name, self.roles, "model_name" in self.model_fields_set)
            specs = _role_specs("eval", self.model, self.model_name, self.roles)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        tasks = load_tasks(self.tasks, self.split)
        reward_fn = _reward_fn(self.reward)
        run_dir = _run_dir(self.runs, self.name)
        _save_config(run_dir, self)
        store_path = run_dir / "traces.db"
        stack = start_roles_stack(specs, remote_roles(self.roles), store_path, self.engine)
        _remember_store(store_path)
        cfg = self.runner.model_copy(update={"model": top})
        with ThreadPoolExecutor(cfg.concurrency) as threads:
            agent = load_agent(self.agent, threads)
            try:
                rep = evaluate(stack.store, stack.url, agent, reward_fn, tasks, self.repeats, cfg)
            finally:
                stack.close()
        (run_dir / "eval.json").write_text(rep.model_dump_json(indent=2))
        _print_report(rep)
        console.print(f"traces: {store_path}")


def _role_specs(
    command: str, model: str, model_name: str, roles: dict[str, RoleConfig]
) -> list[PolicySpec]:
    """The policies to serve: `model` as `model_name`, or each role of `roles` (ValueError
    with what is wrong: nothing to serve, a bad mapping, a model dir that is not there)."""
    if not model and not roles:
        raise ValueError(f"{command} needs --model DIR (or --roles for several roles)")
    specs = resolve_roles(roles or {model_name: RoleConfig()}, model)
    check_local_models(specs, bool(roles))
    return specs


def _print_report(rep: BaseModel) -> None:
    data = rep.model_dump()
    console.print(
        f"[bold green]success {data['success_rate']:.1%}[/bold green] over "
        f"{data['rollouts']} rollouts · mean reward {data['mean_reward']:.3f} · "
        f"{data['mean_calls']:.2f} calls/rollout · {data['wall_s']:.1f} s"
    )
    console.print(
        f"statuses {data['statuses']} · prompt {data['mean_prompt_tokens']:.0f} tok/call · "
        f"completion {data['mean_completion_tokens']:.1f} tok/call · reused "
        f"{data['reused_fraction']:.1%} of prompt tokens · {data['prefix_breaks']} prefix breaks "
        f"· {data['completion_tokens_per_s']:.0f} completion tok/s"
    )
    if len(data.get("roles") or {}) > 1:
        for role, st in data["roles"].items():
            console.print(
                f"role {role}: {st['calls_per_rollout']:.2f} calls/rollout · "
                f"{st['agents_per_rollout']:.2f} agents/rollout · "
                f"{st['completion_tokens_per_call']:.1f} completion tok/call"
            )


def _open_store(path: str | None):  # type: ignore[no-untyped-def]
    from tracerl.store.sqlite import SqliteStore

    if path is None:
        if not LATEST.exists():
            raise SystemExit("no store given and no previous run found; pass --store PATH")
        path = LATEST.read_text().strip()
    if path.startswith("http"):
        from tracerl.store.http import StoreClient

        return StoreClient(path)
    if not Path(path).exists():
        raise SystemExit(f"no store at {path}")
    return SqliteStore(path)


class TracesShow(_Cmd):
    """Print one rollout: every model call with its messages, tokens, policy version,
    latency, and the reward."""

    rollout_id: CliPositionalArg[str]
    """The rollout to show."""
    store: str | None = None
    """Store file or URL (default: the last run's)."""

    def cli_cmd(self) -> None:
        from tracerl.store import NotFound
        from tracerl.traces import show_rollout

        try:
            show_rollout(_open_store(self.store), self.rollout_id, console)
        except NotFound as e:
            raise SystemExit(str(e)) from None


class TracesList(_Cmd):
    """List recent rollouts."""

    store: str | None = None
    """Store file or URL (default: the last run's)."""
    limit: int = 20
    """How many."""

    def cli_cmd(self) -> None:
        from tracerl.traces import list_rollouts

        list_rollouts(_open_store(self.store), self.limit, console)


class Traces(_Cmd):
    """Read recorded traces."""

    show: CliSubCommand[TracesShow]
    list: CliSubCommand[TracesList]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


class Sft(_Cmd):
    """Supervised warm start of a local model (or a new tiny one) from demonstrations."""

    demos: str
    """Demonstrations JSONL: one {"messages": [...], "tools": [...]} per line."""
    out: str
    """Output HF model directory."""
    base: str | None = None
    """Local HF model dir to start from; default: build a new tiny model on the demos."""
    steps: int | None = None
    """Optimizer steps (default: SftConfig's)."""
    stop_loss: float | None = None
    """Stop early once the running loss is below this (default: never)."""
    lr: float | None = None
    """Peak learning rate (default: SftConfig's)."""
    seed: int = 0
    """Seed."""

    def cli_cmd(self) -> None:
        from tracerl.models.sft import SftConfig, load_demos, sft
        from tracerl.models.template import render_chat
        from tracerl.models.tiny import TinyModelConfig, build_tiny_model

        demos = load_demos(self.demos)
        base = self.base
        if base is None:
            base = str(Path(self.out).with_name(Path(self.out).name + "-base"))
            build_tiny_model(
                base, [render_chat(d.messages, d.tools) for d in demos], TinyModelConfig()
            )
        update: dict[str, object] = {"seed": self.seed}
        if self.steps is not None:
            update["steps"] = self.steps
        if self.stop_loss is not None:
            update["stop_loss"] = self.stop_loss
        if self.lr is not None:
            update["lr"] = self.lr
        result = sft(base, demos, self.out, SftConfig().model_copy(update=update))
        console.print(
            f"saved {result.out_dir}: {result.steps} steps, final loss {result.final_loss:.3f}, "
            f"{result.tokens_per_s:.0f} tok/s"
        )


class Serve(_Cmd):
    """Run the store and the gateway as their own process, for runners elsewhere."""

    model: str = ""
    """Local HF model directory to serve (the default of every role without its own)."""
    roles: dict[str, RoleConfig] = {}
    """Several roles, as in `tracerl train` (JSON, e.g. '{"planner": {"model": "m/p"},
    "executor": {"share": "planner"}}'): one engine per policy, remote roles forwarded."""
    store: str = "runs/serve/traces.db"
    """SQLite store file."""
    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = 8000
    """Port to listen on."""
    model_name: str = "policy"
    """The model name agents ask for (without `--roles`)."""
    engine: EngineConfig = EngineConfig()
    """How the model is served."""

    def cli_cmd(self) -> None:
        try:
            specs = _role_specs("serve", self.model, self.model_name, self.roles)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        Path(self.store).parent.mkdir(parents=True, exist_ok=True)
        remote = remote_roles(self.roles)
        stack = start_roles_stack(specs, remote, self.store, self.engine, self.host, self.port)
        names = ", ".join(stack.gateway.names)
        console.print(f"gateway: {stack.url}/v1 · per rollout: {stack.url}/rollouts/<id>/v1")
        console.print(f"models: {names} · store API: {stack.url}/store · file {self.store}")
        try:
            while stack.server.thread.is_alive():
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            stack.close()


class RunnerCmd(_Cmd):
    """Run a pool of workers that claim rollouts from a remote store and run the agent."""

    agent: CliPositionalArg[str]
    """The agent: 'file.py:function', 'module:function', or 'cmd:<command line>'."""
    url: str
    """Base URL of `tracerl serve` (store API at <url>/store, gateway at <url>)."""
    reward: str | None = None
    """Reward function 'file.py:function'."""
    until_idle: bool = True
    """Exit once nothing is queued or running."""
    runner: RunnerConfig = RunnerConfig()
    """How rollouts are run."""

    def cli_cmd(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from tracerl.runner import Runner
        from tracerl.store.http import StoreClient

        store = StoreClient(self.url.rstrip("/") + "/store")
        with ThreadPoolExecutor(self.runner.concurrency) as threads:
            agent = load_agent(self.agent, threads)
            runner = Runner(store, self.url, agent, _reward_fn(self.reward), self.runner)
            asyncio.run(runner.run(until_idle=self.until_idle))
        console.print(json.dumps({"runner": runner.id, "finished": runner.finished}))


class Train(TrainConfig):
    """Train any agent on any task file with RL through the gateway: evaluate, train,
    evaluate. Fields come from an optional TOML file, then from flags."""

    config: CliPositionalArg[str] = ""
    """TOML file with any of the fields below (sections for nested ones)."""
    resume: str | None = None
    """Continue the run in this directory (runs/<name>) from its last checkpoint."""

    def cli_cmd(self) -> None:
        import tomllib

        from tracerl.pipeline.run import load_run_config, train

        explicit = self.model_dump(exclude_unset=True)
        explicit.pop("config", None)
        explicit.pop("resume", None)
        if self.resume:
            base = load_run_config(self.resume).model_dump()
        elif self.config:
            base = tomllib.loads(Path(self.config).read_text())
        else:
            base = {}
        cfg = TrainConfig.model_validate(_merge(base, explicit))
        try:
            cfg.check()
        except ValueError as e:
            raise SystemExit(str(e)) from None
        summary = train(cfg, resume=self.resume is not None)
        console.print(summary.model_dump_json(indent=2))


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


class Tracerl(
    BaseSettings,
    cli_prog_name="tracerl",
    cli_kebab_case=False,
    cli_implicit_flags=True,
    cli_use_class_docs_for_groups=True,
    use_attribute_docstrings=True,
):
    """tracerl: reinforcement learning for LLM agents from the traces of the agents as they
    already are. Point your agent's base_url at the gateway; tracerl records, trains, serves."""

    demo: CliSubCommand[Demo]
    train: CliSubCommand[Train]
    eval: CliSubCommand[Eval]
    traces: CliSubCommand[Traces]
    sft: CliSubCommand[Sft]
    serve: CliSubCommand[Serve]
    runner: CliSubCommand[RunnerCmd]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `tracerl` command."""
    args = sys.argv[1:] if argv is None else argv
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own bars say what is happening; theirs are noise
    if not args:
        args = ["--help"]
    CliApp.run(Tracerl, cli_args=args)


if __name__ == "__main__":
    main()
