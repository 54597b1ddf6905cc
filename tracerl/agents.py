"""How user agent code is loaded and called: a Python callable (by file path or module) or
an external command in any language.

A Python callable `run(task_input, *, base_url, api_key, model)` (sync ones run in threads,
async ones on the loop); a file is loaded by path, never through sys.path, each folder as
its own package so its siblings import as `from . import x`. An external command reads
OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL and the task (JSON, in TRACERL_TASK and on
stdin), prints its answer as the last line of stdout, and may POST its reward to
TRACERL_REWARD_URL.
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
import os
import shlex
import sys
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from tracerl.types import Task

__all__ = [
    "AgentFn",
    "AgentResult",
    "RewardFn",
    "command_agent",
    "load_agent",
    "load_callable",
    "load_file",
    "python_agent",
]


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
