"""`tracerl runner`: a pool of workers, its own process, claiming rollouts from a remote
store and running the agent against the gateway beside it."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

from rich.console import Console

from tracerl.agents import load_agent, load_callable
from tracerl.entrypoints.config import RunnerCommand
from tracerl.runner import Runner
from tracerl.store.http import StoreClient


def main(cfg: RunnerCommand, console: Console) -> None:
    """Run rollouts until idle (or forever); print how many this runner finished."""
    store = StoreClient(cfg.url.rstrip("/") + "/store")
    reward_fn = load_callable(cfg.reward) if cfg.reward else None
    with ThreadPoolExecutor(cfg.runner.concurrency) as threads:
        agent = load_agent(cfg.agent, threads)
        runner = Runner(store, cfg.url, agent, reward_fn, cfg.runner, model=cfg.model_name)
        asyncio.run(runner.run(until_idle=cfg.until_idle))
    console.print(json.dumps({"runner": runner.id, "finished": runner.finished}))
