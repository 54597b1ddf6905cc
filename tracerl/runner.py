"""The runner: a pool of concurrent workers that claim rollouts and run the user's agent.

A worker claims a rollout from the store, hands the agent its per-rollout base_url (so the
gateway attributes every model call to it), keeps the lease alive with heartbeats, enforces
a timeout, works out the reward and finishes the rollout. An agent that raises or hangs
becomes a failed or timed-out rollout with the error stored; it never stops the pool. If
the runner process dies, its leases expire and the store re-queues the rollouts for
another runner.

Agents come in two forms: a Python callable `run(task_input, *, base_url, api_key, model)`
(sync ones run in threads, async ones on the loop), or an external command in any language
that reads OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL and the task (JSON, in
TRACERL_TASK and on stdin), prints its answer as the last line of stdout, and may POST its
reward to TRACERL_REWARD_URL. The API key is the attempt's own when the service has keys
(sent as a Bearer token, it opens that attempt's model calls and reward only).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import logging
import os
import shlex
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tracerl.store import LeaseLost, Store, StoreError, StoreUnavailable
from tracerl.types import Rollout, RolloutStatus, Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentResult:
    """What an agent hands back for one rollout."""

    answer: str | None
    """The final answer (what the reward function judges)."""
    reward: float | None = None
    """A reward the agent computed itself; wins over every other source."""


AgentFn = Callable[[Task, str, str, str], Awaitable[AgentResult]]
"""(task, base_url, api_key, model) -> result, awaitable."""

RewardFn = Callable[[dict[str, Any], str], float]
"""(task as in the task file, answer) -> reward."""


def load_file(path: str | Path) -> ModuleType:
    """Import a Python file by path, leaving sys.path alone.

    The file's folder becomes a package with a name of its own (derived from the folder's
    path), so two folders that each hold an `agent.py` and a `tasks.py` never share a module,
    and a file imports its siblings relatively (`from . import tasks`), each its own folder's.
    A file is executed once per process; later calls return the same module.
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    digest = hashlib.sha1(str(path.parent).encode()).hexdigest()[:12]
    package = f"tracerl_files.{_identifier(path.parent.name)}_{digest}"
    _ensure_package("tracerl_files", [])
    _ensure_package(package, [str(path.parent)])
    name = f"{package}.{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a file that failed to import is retried, not half-loaded
        raise
    return module


def _identifier(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text) or "_"


def _ensure_package(name: str, search: list[str]) -> None:
    """A package module `name` whose submodules are found in the folders `search`."""
    if name not in sys.modules:
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = search
        sys.modules[name] = importlib.util.module_from_spec(spec)


def load_callable(spec: str) -> Callable[..., Any]:
    """Resolve 'path/to/file.py:name' or 'package.module:name' to the object it names."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"expected 'file.py:function' or 'module:function', got {spec!r}")
    if target.endswith(".py"):
        if not Path(target).is_file():
            raise FileNotFoundError(f"no such agent file: {target}")
        module = load_file(target)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise AttributeError(f"{target} has no callable {name!r}")
    return fn


def _result(value: Any) -> AgentResult:
    """Accept what agents naturally return: a string, a dict, or an AgentResult."""
    if isinstance(value, AgentResult):
        return value
    if isinstance(value, dict):
        reward = value.get("reward")
        answer = value.get("answer")
        return AgentResult(
            None if answer is None else str(answer), None if reward is None else float(reward)
        )
    return AgentResult(None if value is None else str(value))


def python_agent(fn: Callable[..., Any], threads: ThreadPoolExecutor) -> AgentFn:
    """Wrap a user function; sync functions run on the thread pool."""

    async def call(task: Task, base_url: str, api_key: str, model: str) -> AgentResult:
        kwargs = {"base_url": base_url, "api_key": api_key, "model": model}
        if inspect.iscoroutinefunction(fn):
            return _result(await fn(task.input, **kwargs))
        loop = asyncio.get_running_loop()
        value = await loop.run_in_executor(threads, functools.partial(fn, task.input, **kwargs))
        return _result(value)

    return call


def command_agent(command: str) -> AgentFn:
    """Wrap an external command (any language); killed when the rollout times out."""
    argv = shlex.split(command)

    async def call(task: Task, base_url: str, api_key: str, model: str) -> AgentResult:
        payload = json.dumps(task.input)
        env = {
            **os.environ,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": api_key,
            "OPENAI_MODEL": model,
            "TRACERL_TASK": payload,
            "TRACERL_REWARD_URL": base_url.removesuffix("/v1") + "/reward",
        }
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        try:
            out, err = await proc.communicate(payload.encode())
        except asyncio.CancelledError:
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"agent command exited {proc.returncode}: " + "\n".join(tail))
        lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
        return AgentResult(lines[-1].strip() if lines else "")

    return call


def load_agent(spec: str, threads: ThreadPoolExecutor) -> AgentFn:
    """'cmd:<command line>' for an external command, else a Python callable spec."""
    if spec.startswith("cmd:"):
        return command_agent(spec.removeprefix("cmd:").strip())
    return python_agent(load_callable(spec), threads)


class RunnerConfig(BaseModel):
    """How a pool of workers runs rollouts."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    concurrency: int = Field(default=16, ge=1)
    """Rollouts in flight at once (agents are mostly waiting on the model)."""
    timeout_s: float = Field(default=120.0, gt=0)
    """Wall time one rollout may take before it is finished as timed_out."""
    lease_s: float = Field(default=30.0, gt=0)
    """Lease length; heartbeats renew it every lease_s / 3."""
    api_key: str = "tracerl"
    """The API key handed to the agent when the claim carries none of its own (a store in
    this process: its gateway has no keys)."""
    poll_s: float = Field(default=0.05, gt=0)
    """Sleep between claims when nothing is queued."""


class Runner:
    """Claims rollouts from a store and runs them through the gateway, concurrently."""

    def __init__(
        self,
        store: Store,
        gateway_url: str,
        agent: AgentFn,
        reward_fn: RewardFn | None,
        cfg: RunnerConfig | None = None,
        runner_id: str | None = None,
        on_finish: Callable[[Rollout], None] | None = None,
        model: str = "policy",
    ) -> None:
        self.store = store
        self.gateway_url = gateway_url.rstrip("/")
        self.agent = agent
        self.reward_fn = reward_fn
        self.cfg = cfg or RunnerConfig()
        self.id = runner_id or f"runner-{uuid.uuid4().hex[:8]}"
        self.on_finish = on_finish or (lambda r: None)
        self.model = model
        """The `model` name handed to the agent: the role its calls are served as (the run's
        `model_name`)."""
        self.finished = 0
        self.paused = False
        """While set, running rollouts go on but nothing new is claimed (another pool, e.g.
        a held-out evaluation's, has the queue to itself)."""
        self.busy_s = 0.0
        """Summed wall time of rollouts run (for utilisation: busy_s / (slots x wall))."""

    async def run(self, until_idle: bool = True, stop: asyncio.Event | None = None) -> None:
        """Keep up to `concurrency` rollouts running until nothing is queued or running
        (until_idle) or `stop` is set; then let the running ones finish.

        A slot that frees up is refilled at once (one claim for all free slots), so a
        long-tail rollout never holds the others back. With nothing to claim, the pool
        polls, backing off to once a second, for rollouts that come back (a dead runner's
        expired lease) or new work.
        """
        stop = stop or asyncio.Event()
        delay = self.cfg.poll_s
        active: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            free = self.cfg.concurrency - len(active)
            claimed = []
            if free > 0 and not self.paused:
                claimed = await self._claim(free)
            for rollout in claimed:
                task = asyncio.create_task(self.run_one(rollout))
                active.add(task)
                task.add_done_callback(active.discard)
            if claimed:
                delay = self.cfg.poll_s
                continue
            if until_idle and not active and await asyncio.to_thread(self._idle):
                return
            if active:  # wake when a slot frees up, or poll again after `delay`
                await asyncio.wait(active, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)
        if active:
            await asyncio.gather(*active, return_exceptions=True)

    async def _claim(self, n: int) -> list[Rollout]:
        """Up to n rollouts; none while the store is unreachable (a remote store restarting):
        the pool keeps polling, with its usual back-off, instead of exiting."""
        try:
            return await asyncio.to_thread(self.store.claim, self.id, n, self.cfg.lease_s)
        except StoreUnavailable as e:
            log.warning("claim failed, will retry: %s", e.message)
            return []

    def _idle(self) -> bool:
        try:
            counts = self.store.counts()
        except StoreUnavailable:
            return False  # cannot tell while the store is away: keep polling
        return not counts.get("queued", 0) and not counts.get("running", 0)

    async def run_one(self, rollout: Rollout) -> None:
        """Run one claimed rollout to a final state (or abandon it if its lease is lost)."""
        started = time.perf_counter()
        try:
            await self._run_one(rollout)
        finally:
            self.busy_s += time.perf_counter() - started

    async def _run_one(self, rollout: Rollout) -> None:
        task = await asyncio.to_thread(self.store.get_task, rollout.task_id)
        base_url = f"{self.gateway_url}/rollouts/{rollout.id}/v1"
        # The attempt's own key when the store minted one (a claim over HTTP): it opens
        # this attempt's model calls and reward only, and dies with the attempt.
        minted = getattr(self.store, "agent_key", None)
        api_key = (minted and minted(rollout.id, rollout.attempt)) or self.cfg.api_key
        run: asyncio.Future[AgentResult] = asyncio.ensure_future(
            self.agent(task, base_url, api_key, self.model)
        )
        beat = asyncio.create_task(self._heartbeat(rollout, run))
        answer, reward, error = None, None, None
        status = RolloutStatus.succeeded
        try:
            result = await asyncio.wait_for(run, self.cfg.timeout_s)
            answer = result.answer
            reward = await asyncio.to_thread(self._reward, task, rollout, result)
        except TimeoutError:
            status, error = RolloutStatus.timed_out, f"timed out after {self.cfg.timeout_s:g}s"
        except asyncio.CancelledError:
            if not beat.done():
                raise
            return  # the heartbeat found the lease lost: another runner owns it now
        except Exception as e:  # the agent's failure is data, not a crash of the pool
            status, error = RolloutStatus.failed, _error_text(e)
        finally:
            beat.cancel()
        await self._finish(rollout, status, answer, reward, error)

    async def _finish(
        self,
        rollout: Rollout,
        status: RolloutStatus,
        answer: str | None,
        reward: float | None,
        error: str | None,
    ) -> None:
        try:
            done = await asyncio.to_thread(
                self.store.finish, rollout.id, rollout.attempt, status, answer, reward, error
            )
        except LeaseLost:
            return  # re-queued meanwhile; the new attempt will be finished by its runner
        self.finished += 1
        self.on_finish(done)

    def _reward(self, task: Task, rollout: Rollout, result: AgentResult) -> float | None:
        """The agent's own reward, else one it emitted over HTTP, else the reward function."""
        if result.reward is not None:
            return result.reward
        emitted = [
            r
            for r in self.store.rewards(rollout.id, rollout.attempt)
            if r.span_seq is None and r.role is None
        ]
        if emitted:
            return emitted[-1].value
        if self.reward_fn is None:
            return None
        return float(self.reward_fn(task.model_dump(), result.answer or ""))

    async def _heartbeat(self, rollout: Rollout, run: asyncio.Future[AgentResult]) -> None:
        while True:
            await asyncio.sleep(self.cfg.lease_s / 3)
            try:
                await asyncio.to_thread(
                    self.store.heartbeat, rollout.id, rollout.attempt, self.cfg.lease_s
                )
            except LeaseLost:
                run.cancel()
                return
            except StoreError:
                continue  # a passing store hiccup; the lease still has time


def _error_text(e: BaseException) -> str:
    lines = traceback.format_exception_only(type(e), e)
    return "".join(lines).strip()[-2000:]
