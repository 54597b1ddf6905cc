"""`tracerl assets`: prompts and skills as named, versioned texts in a store: put, list,
show, diff; compare two versions on tasks (paired); optimize one from its traces.

The configs are here, beside the entry point, and import nothing heavy (the CLI reads them
for --help); `compare` and `optimize` serve the model (tracerl.pipeline.run's stack) only
when they run. The business logic is tracerl.assets.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, ValidationError
from pydantic_settings import CliPositionalArg, CliSubCommand
from rich.console import Console
from rich.table import Table

from tracerl.assets.config import OptimizeSettings
from tracerl.assets.records import Asset, AssetRef, Comparison, Optimization, Test
from tracerl.entrypoints.config import Command, ServingConfig, config_errors
from tracerl.runner import RunnerConfig

if TYPE_CHECKING:  # annotations only: the CLI's --help loads none of these
    from tracerl.assets.proposers import Proposer
    from tracerl.stack import LocalStack
    from tracerl.store import Store

__all__ = [
    "AssetsCommand",
    "AssetsCompare",
    "AssetsDiff",
    "AssetsList",
    "AssetsOptimize",
    "AssetsPut",
    "AssetsShow",
    "main",
]

STORE = "runs/assets/traces.db"
"""Where assets live unless --store says otherwise (the dashboard shows it as run
'assets')."""


class AssetsPut(Command):
    """Store a file's text as the next version of an asset (it becomes the current one)."""

    name: CliPositionalArg[str]
    """The asset's name (letters, digits, '_', '.', '-')."""
    file: CliPositionalArg[str]
    """The text file ('-' for standard input)."""
    note: str = ""
    """Why this version exists."""
    store: str = STORE
    """The store: a SQLite file (created when missing), or a postgresql:// URL."""


class AssetsList(Command):
    """Every asset: its current version, how many versions it has, its first line."""

    store: str = STORE
    """The store: a SQLite file (created when missing), or a postgresql:// URL."""


class AssetsShow(Command):
    """One version's text and note (NAME: the current one), and the asset's versions."""

    asset: CliPositionalArg[str]
    """NAME, NAME@3 or NAME@v3."""
    store: str = STORE
    """The store: a SQLite file (created when missing), or a postgresql:// URL."""


class AssetsDiff(Command):
    """A unified diff between two versions (or a version and the current one)."""

    a: CliPositionalArg[str]
    """NAME@N: the old version."""
    b: CliPositionalArg[str]
    """NAME@N, or NAME for the current one: the new version."""
    store: str = STORE
    """The store: a SQLite file (created when missing), or a postgresql:// URL."""


class _Arms(ServingConfig):
    """What both compare and optimize need to run arms: a served model, an agent, tasks."""

    agent: str
    """The agent: 'file.py:function', 'module:function', or 'cmd:<command line>'."""
    tasks: str
    """Task file (JSONL: one {"id", "input", "answer", "split"} per line)."""
    reward: str | None = None
    """Reward function 'file.py:function' called as f(task, answer); optional when the
    agent returns or emits its own reward."""
    success_threshold: float = 1.0
    """A rollout with an outcome and a reward at or above this is a success."""
    store: str = STORE
    """The store holding the asset (a SQLite file or a postgresql:// URL), where the gateway
    records the arms' rollouts and the results are kept."""
    runner: RunnerConfig = RunnerConfig()
    """How rollouts are run."""


class AssetsCompare(_Arms):
    """Run the tasks with two versions of an asset, paired (same tasks, repeats and seeds):
    each one's success, what B repairs and breaks, and a paired significance test."""

    a: CliPositionalArg[str]
    """Arm A, the incumbent: NAME@N, NAME (current), NAME@0 (without the asset)."""
    b: CliPositionalArg[str]
    """Arm B, the candidate."""
    split: str | None = None
    """Only tasks of this split (default: all)."""
    repeats: int = Field(default=1, ge=1)
    """Rollouts per task in each arm."""
    test: Test = "mcnemar"
    """'mcnemar' (exact, over the discordant pairs) or 'bootstrap' (resampling tasks)."""
    seed: int = 0
    """Base of the per-pair sampling seeds."""


class AssetsOptimize(_Arms):
    """Search for a better version from the traces of the current one: a proposer writes
    candidates from failures beside successes, each is compared on a train split, an
    archive keeps the complementary ones, and the best is accepted (put as the new current
    version) only if it wins on held-out tasks with significance."""

    asset: CliPositionalArg[str]
    """NAME (start from the current version) or NAME@N."""
    eval_tasks: str | None = None
    """Held-out task file; default: the 'eval' split of --tasks, else --holdout of them."""
    holdout: float = Field(default=0.5, gt=0, lt=1)
    """Without held-out tasks: the share of --tasks held out (seeded by --optimize.seed)."""
    proposer: Literal["llm", "bootstrap"] = "llm"
    """'llm': a model rewrites the text; 'bootstrap': worked examples from successful traces
    are added (no model)."""
    proposer_url: str | None = None
    """The LLM proposer's OpenAI-compatible base URL (up to /v1); default: the served
    policy, through the gateway (its calls recorded token by token)."""
    proposer_model: str | None = None
    """The model name to ask for; default: the served policy's (--model_name)."""
    proposer_key_env: str | None = None
    """The environment variable holding the proposer's API key (keys are never flags)."""
    optimize: OptimizeSettings = OptimizeSettings()
    """Rounds, candidates per round, repeats, alpha, the paired test, seeds."""


class AssetsCommand(Command):
    """Prompts and skills as named, versioned texts the gateway applies to agents' calls."""

    put: CliSubCommand[AssetsPut]
    """Store a new version."""
    list: CliSubCommand[AssetsList]
    """List assets."""
    show: CliSubCommand[AssetsShow]
    """Print a version."""
    diff: CliSubCommand[AssetsDiff]
    """Diff two versions."""
    compare: CliSubCommand[AssetsCompare]
    """Compare two versions on tasks, paired."""
    optimize: CliSubCommand[AssetsOptimize]
    """Optimize an asset from its traces."""


def main(cfg: AssetsCommand, console: Console) -> None:
    """Run the chosen subcommand (SystemExit with a message for a person's mistake)."""
    from tracerl.store import StoreError

    try:
        _dispatch(cfg, console)
    except ValidationError as e:  # a record refusing a value (an empty text, ...)
        raise SystemExit(f"tracerl assets: {config_errors(e)}") from None
    except StoreError as e:
        raise SystemExit(f"tracerl assets: {e.message}") from None
    except ValueError as e:
        raise SystemExit(f"tracerl assets: {e}") from None


def _dispatch(cfg: AssetsCommand, console: Console) -> None:
    if cfg.put is not None:
        _put(cfg.put, console)
    elif cfg.list is not None:
        _list(cfg.list, console)
    elif cfg.show is not None:
        _show(cfg.show, console)
    elif cfg.diff is not None:
        _diff(cfg.diff, console)
    elif cfg.compare is not None:
        _compare(cfg.compare, console)
    elif cfg.optimize is not None:
        _optimize(cfg.optimize, console)


def _open(store: str, create: bool = False) -> Store:
    """The store at `store` (a file's folder made when `create`)."""
    from tracerl.store.open import is_postgres_url, open_store

    if not is_postgres_url(store) and not store.startswith("http") and store != ":memory:":
        if not create and not Path(store).exists():
            raise SystemExit(f"tracerl assets: no store at {store} (put an asset there first)")
        Path(store).parent.mkdir(parents=True, exist_ok=True)
    return open_store(store)


def _put(cfg: AssetsPut, console: Console) -> None:
    import sys

    if AssetRef.parse(cfg.name).version is not None:
        raise ValueError(f"{cfg.name!r}: put takes a NAME; the store numbers the version")
    text = sys.stdin.read() if cfg.file == "-" else _read(cfg.file)
    store = _open(cfg.store, create=True)
    try:
        asset = store.put_asset(cfg.name, text, cfg.note)
    finally:
        store.close()
    console.print(f"{asset.name}@{asset.version} stored (now current) in {cfg.store}")


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise SystemExit(f"tracerl assets: cannot read {path}: {e.strerror}") from None


def _list(cfg: AssetsList, console: Console) -> None:
    store = _open(cfg.store)
    try:
        current = store.assets()
        counts = {a.name: len(store.asset_versions(a.name)) for a in current}
    finally:
        store.close()
    table = Table("asset", "current", "versions", "first line")
    for a in current:
        table.add_row(a.name, f"v{a.version}", str(counts[a.name]), _first_line(a.text))
    console.print(table if current else f"no assets in {cfg.store}")


def _first_line(text: str, width: int = 60) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def _show(cfg: AssetsShow, console: Console) -> None:
    ref = AssetRef.parse(cfg.asset)
    store = _open(cfg.store)
    try:
        asset = store.asset(ref.name, ref.version)
        versions = store.asset_versions(ref.name)
    finally:
        store.close()
    kind = " (candidate)" if asset.candidate else ""
    console.print(f"[bold]{asset.name}@{asset.version}[/bold]{kind}  {asset.note}", highlight=False)
    console.print(asset.text, markup=False, highlight=False)
    console.print(f"versions: {', '.join(_version_label(v) for v in versions)}", highlight=False)


def _version_label(a: Asset) -> str:
    return f"v{a.version}{'*' if a.candidate else ''}"


def _diff(cfg: AssetsDiff, console: Console) -> None:
    a, b = AssetRef.parse(cfg.a), AssetRef.parse(cfg.b)
    store = _open(cfg.store)
    try:
        old, new = store.asset(a.name, a.version), store.asset(b.name, b.version)
    finally:
        store.close()
    lines = difflib.unified_diff(
        old.text.splitlines(keepends=True), new.text.splitlines(keepends=True),
        fromfile=f"{old.name}@{old.version}", tofile=f"{new.name}@{new.version}",
    )  # fmt: skip
    console.print("".join(lines).rstrip("\n") or "(no difference)", markup=False, highlight=False)


# -- compare and optimize: serve the model, run arms ----------------------------------------


def _arena_stack(cfg: _Arms) -> tuple[str, LocalStack]:
    """The served stack over cfg.store and the pieces of its Arena (loaded here: torch)."""
    from tracerl.entrypoints import quiet_model_loading
    from tracerl.pipeline.run import start_roles_stack
    from tracerl.roles import remote_roles

    quiet_model_loading()
    if cfg.store.startswith("http"):
        raise SystemExit(
            "tracerl assets: compare and optimize serve the model over a store file or postgresql:// URL"
        )
    _open(cfg.store, create=True).close()
    top, specs = cfg.top_model(), cfg.policies("assets")
    remote = remote_roles(cfg.roles, cfg.reply_format())
    return top, start_roles_stack(specs, remote, cfg.store, cfg.engine, gateway=cfg.gateway)


def _compare(cfg: AssetsCompare, console: Console) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tracerl.agents import load_agent, load_callable
    from tracerl.assets.compare import Arena, compare
    from tracerl.evaluate import load_tasks

    a, b = AssetRef.parse(cfg.a), AssetRef.parse(cfg.b)
    tasks = load_tasks(cfg.tasks, cfg.split)
    reward_fn = load_callable(cfg.reward) if cfg.reward else None
    top, stack = _arena_stack(cfg)
    with ThreadPoolExecutor(cfg.runner.concurrency) as threads:
        try:
            agent = load_agent(cfg.agent, threads)
            arena = Arena(
                stack.store, stack.url, agent, reward_fn, cfg.runner, top, cfg.success_threshold
            )
            c = compare(arena, a, b, tasks, cfg.repeats, cfg.seed, cfg.test)
        finally:
            stack.close()
    print_comparison(c, console)


def print_comparison(c: Comparison, console: Console) -> None:
    """A comparison as a person reads it."""
    console.print(
        f"[bold]{c.label}[/bold] over {len(c.pairs)} paired rollouts: success "
        f"{c.success_a:.1%} -> {c.success_b:.1%} · repairs {c.repairs} · regressions "
        f"{c.regressions} · p = {c.p_value:.3g} ({c.test}) · comparison {c.id}",
        highlight=False,
    )
    broke = sorted({p.task_id for p in c.pairs if p.a and not p.b})
    if broke:
        console.print(f"broken by B: {', '.join(broke[:20])}", highlight=False)


def _optimize(cfg: AssetsOptimize, console: Console) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tracerl.agents import load_agent, load_callable
    from tracerl.assets.compare import Arena
    from tracerl.assets.optimize import Optimizer, split_held_out
    from tracerl.evaluate import load_tasks

    ref = AssetRef.parse(cfg.asset)
    tasks = load_tasks(cfg.tasks)
    if cfg.eval_tasks:
        train, held_out = [t for t in tasks if t.split != "eval"], load_tasks(cfg.eval_tasks)
    else:
        train, held_out = split_held_out(tasks, cfg.holdout, cfg.optimize.seed)
    reward_fn = load_callable(cfg.reward) if cfg.reward else None
    top, stack = _arena_stack(cfg)
    with ThreadPoolExecutor(cfg.runner.concurrency) as threads:
        try:
            agent = load_agent(cfg.agent, threads)
            arena = Arena(
                stack.store, stack.url, agent, reward_fn, cfg.runner, top, cfg.success_threshold
            )
            proposer = _proposer(cfg, stack.store, stack.url, top, ref.name)
            opt = Optimizer(arena, ref.name, proposer, cfg.optimize).run(ref, train, held_out)
        finally:
            stack.close()
    print_optimization(opt, console)


def _proposer(cfg: AssetsOptimize, store: Store, gateway_url: str, top: str, name: str) -> Proposer:
    from tracerl.assets.proposers import BootstrapProposer, LlmProposer

    if cfg.proposer == "bootstrap":
        return BootstrapProposer(seed=cfg.optimize.seed)
    # Its own prompts carry none of the agent's assets.
    withhold = {n: 0 for n in [name, *cfg.gateway.assets]}
    key = os.environ.get(cfg.proposer_key_env, "") if cfg.proposer_key_env else "tracerl"
    if cfg.proposer_url is None:
        return LlmProposer(
            store, gateway_url, cfg.proposer_model or top, served=True, withhold=withhold
        )
    return LlmProposer(
        store, cfg.proposer_url, cfg.proposer_model or top, api_key=key, withhold=withhold
    )


def print_optimization(opt: Optimization, console: Console) -> None:
    """An optimization's rounds and verdict."""
    for r in opt.rounds:
        tried = ", ".join(
            f"v{c.version} {c.success:.0%}{' kept' if c.kept else ''}" for c in r.candidates
        )
        console.print(
            f"round {r.index}: from v{r.parent}: {tried or 'no new candidates'} · archive "
            f"{r.archive} · best v{r.best}",
            highlight=False,
        )
    verdict = {
        "accepted": f"accepted: v{opt.best} is the new current version v{opt.accepted}",
        "rejected": "rejected: the seed stays current",
    }.get(opt.status, opt.status)
    p = f" (held-out p = {opt.p_value:.3g}, alpha {opt.alpha:g})" if opt.p_value is not None else ""
    console.print(f"[bold]{opt.name}[/bold] {verdict}{p} · optimization {opt.id}", highlight=False)
