"""LocalStack.close: the HTTP server first, then the gateway's threads, the engines, the
store last; every step runs even when one fails; a second close does nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tracerl.stack import LocalStack, start_stack
from tracerl.store import StoreError
from tracerl.types import SamplingParams


class _Part:
    """Stands in for one part of the stack; writes its name to `log` when closed."""

    def __init__(self, name: str, log: list[str], fail: bool = False) -> None:
        self.name, self.log, self.fail = name, log, fail

    def _closed(self) -> None:
        self.log.append(self.name)
        if self.fail:
            raise RuntimeError(f"{self.name} failed to close")

    stop = close = _closed


def _stack(log: list[str], failing: str = "") -> LocalStack:
    def part(name: str) -> _Part:
        return _Part(name, log, fail=name == failing)

    engines = {"planner": part("engine:planner"), "executor": part("engine:executor")}
    return LocalStack(part("store"), engines, part("gateway"), part("server"))  # type: ignore[arg-type]


def test_close_stops_server_gateway_engines_then_store_once() -> None:
    log: list[str] = []
    stack = _stack(log)
    stack.close()
    stack.close()
    assert log == ["server", "gateway", "engine:planner", "engine:executor", "store"]


def test_a_failing_engine_still_closes_the_store() -> None:
    log: list[str] = []
    stack = _stack(log, failing="engine:planner")
    with pytest.raises(RuntimeError, match="engine:planner failed"):
        stack.close()
    assert log == ["server", "gateway", "engine:planner", "engine:executor", "store"]
    stack.close()  # already closed: nothing runs again
    assert len(log) == 5


def test_a_real_stack_closes_every_part(tiny_model_dir: Path) -> None:
    stack = start_stack(tiny_model_dir, ":memory:")
    assert stack.gateway.models["policy"].tokenizer is stack.engine.tokenizer
    assert httpx.get(f"{stack.url}/health").json()["models"] == ["policy"]
    stack.close()
    stack.close()
    assert not stack.server.thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{stack.url}/health")
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(stack.engine.generate([1, 2], SamplingParams()))
    with pytest.raises(RuntimeError, match="shutdown"):
        stack.gateway.store_executor.submit(print)
    with pytest.raises(StoreError, match="closed"):
        stack.store.counts()
