"""StoreClient: the Store protocol over HTTP, for runners and tools on other machines.

It has the same methods and return types as SqliteStore and raises the same StoreError
subclasses (named in the server's error JSON), so code written against Store works
unchanged. The server side is http.py; what both send is wire.py.

A service with keys wants one on every call: the client sends `api_key` (default: the
TRACERL_API_KEY environment variable, so the key never sits on a command line) as
`Authorization: Bearer`. A runner key's claims come back with each attempt's agent key.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import quote

import httpx
import orjson
from pydantic import BaseModel

from tracerl.assets.records import Asset, Comparison, Optimization
from tracerl.store import StoreError, StoreUnavailable
from tracerl.store.sessions import SessionRequest
from tracerl.store.wire import (
    ASSET,
    ASSETS,
    CLAIMED,
    COMPARISONS,
    COUNTS,
    ERRORS,
    ISSUED,
    OPTIMIZATIONS,
    REWARDS,
    ROLLOUTS,
    SEQS,
    SPANS,
    TASKS,
    VERSION,
    AssetRequest,
    ClaimRequest,
    EnqueueRequest,
    FinishRequest,
    HeartbeatRequest,
    IssueRequest,
    RequeueRequest,
)
from tracerl.types import PolicyVersion, Reward, Rollout, RolloutStatus, Span, Task

if TYPE_CHECKING:
    from tracerl.store import Store

__all__ = ["StoreClient"]

AGENT_KEYS_KEPT = 100_000
"""Agent keys of claimed attempts remembered (the oldest go first)."""


def _raise_for(resp: httpx.Response) -> None:
    """Raise the StoreError subclass named in the error JSON (StoreError for anything else)."""
    try:
        err = orjson.loads(resp.content)["error"]
        kind, message = str(err["type"]), str(err["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        kind, message = "", resp.text
    if kind in ERRORS:
        raise ERRORS[kind](message)
    raise StoreError(f"HTTP {resp.status_code} ({kind or 'no error type'}): {message}")


class StoreClient:
    """A Store reached over HTTP; thread-safe, one keep-alive connection pool."""

    def __init__(self, base_url: str, timeout: float = 30.0, api_key: str | None = None) -> None:
        """`base_url` is the server root (http://host:port); a trailing /store is accepted.
        `api_key` defaults to $TRACERL_API_KEY (none: calls carry no key)."""
        root = base_url.rstrip("/").removesuffix("/store")
        key = api_key if api_key is not None else os.environ.get("TRACERL_API_KEY")
        headers = {"authorization": f"Bearer {key}"} if key else None
        self._http = httpx.Client(base_url=f"{root}/store", timeout=timeout, headers=headers)
        self._agent_keys: OrderedDict[tuple[str, int], str] = OrderedDict()
        self._lock = threading.Lock()  # claims run on worker threads

    def _call(
        self,
        method: str,
        path: str,
        content: bytes | None = None,
        params: Mapping[str, str | int] | None = None,
    ) -> bytes:
        headers = {"content-type": "application/json"} if content is not None else None
        try:
            resp = self._http.request(method, path, content=content, params=params, headers=headers)
        except httpx.TransportError as e:  # refused, reset, timed out: a restarting store
            raise StoreUnavailable(f"store at {self._http.base_url} unreachable: {e}") from e
        if resp.status_code >= 400:
            _raise_for(resp)
        return resp.content

    def _post(self, path: str, body: BaseModel) -> bytes:
        return self._call("POST", path, body.model_dump_json().encode())

    def add_tasks(self, tasks: list[Task]) -> None:
        self._call("POST", "/tasks", TASKS.dump_json(tasks))

    def get_task(self, task_id: str) -> Task:
        return Task.model_validate_json(self._call("GET", f"/tasks/{task_id}"))

    def tasks(self, split: str | None = None) -> list[Task]:
        params = None if split is None else {"split": split}
        return TASKS.validate_json(self._call("GET", "/tasks", params=params))

    def enqueue(
        self,
        task_ids: list[str],
        group_id: str | None = None,
        max_attempts: int = 3,
        assets: dict[str, int] | None = None,
        seeds: list[int] | None = None,
    ) -> list[Rollout]:
        body = EnqueueRequest(
            task_ids=task_ids, group_id=group_id, max_attempts=max_attempts, assets=assets,
            seeds=seeds,
        )  # fmt: skip
        return ROLLOUTS.validate_json(self._post("/rollouts", body))

    def claim(self, runner_id: str, n: int = 1, lease_s: float = 30.0) -> list[Rollout]:
        """Claimed rollouts (plain Rollouts, as every Store returns); each one's agent key
        is kept for `agent_key`."""
        body = ClaimRequest(runner_id=runner_id, n=n, lease_s=lease_s)
        claimed = CLAIMED.validate_json(self._post("/claim", body))
        with self._lock:
            for c in claimed:
                if c.agent_key is not None:
                    self._agent_keys[(c.id, c.attempt)] = c.agent_key
            while len(self._agent_keys) > AGENT_KEYS_KEPT:
                self._agent_keys.popitem(last=False)
        return [Rollout.model_validate(c.model_dump(exclude={"agent_key"})) for c in claimed]

    def agent_key(self, rollout_id: str, attempt: int) -> str | None:
        """The agent key minted with this client's claim of the attempt (None: unknown)."""
        with self._lock:
            return self._agent_keys.get((rollout_id, attempt))

    def open_session(self, key: str, lease_s: float = 600.0) -> Rollout:
        body = SessionRequest(key=key, lease_s=lease_s)
        return Rollout.model_validate_json(self._post("/sessions", body))

    def heartbeat(self, rollout_id: str, attempt: int, lease_s: float = 30.0) -> Rollout:
        body = HeartbeatRequest(attempt=attempt, lease_s=lease_s)
        return Rollout.model_validate_json(self._post(f"/rollouts/{rollout_id}/heartbeat", body))

    def get_rollout(self, rollout_id: str) -> Rollout:
        return Rollout.model_validate_json(self._call("GET", f"/rollouts/{rollout_id}"))

    def add_span(self, span: Span) -> None:
        self.add_spans([span])

    def add_spans(self, spans: list[Span]) -> None:
        self._call("POST", "/spans", SPANS.dump_json(spans))

    def append_spans(self, spans: list[Span]) -> list[int]:
        return SEQS.validate_json(self._call("POST", "/spans/append", SPANS.dump_json(spans)))

    def add_reward(self, reward: Reward) -> None:
        self._call("POST", "/rewards", reward.model_dump_json().encode())

    def finish(
        self,
        rollout_id: str,
        attempt: int,
        status: RolloutStatus,
        answer: str | None = None,
        reward: float | None = None,
        error: str | None = None,
    ) -> Rollout:
        body = FinishRequest(
            attempt=attempt, status=status, answer=answer, reward=reward, error=error
        )
        try:
            return Rollout.model_validate_json(self._post(f"/rollouts/{rollout_id}/finish", body))
        finally:
            with self._lock:
                self._agent_keys.pop((rollout_id, attempt), None)

    def spans(self, rollout_id: str, attempt: int | None = None) -> list[Span]:
        params = None if attempt is None else {"attempt": attempt}
        return SPANS.validate_json(
            self._call("GET", f"/rollouts/{rollout_id}/spans", params=params)
        )

    def rewards(self, rollout_id: str, attempt: int | None = None) -> list[Reward]:
        params = None if attempt is None else {"attempt": attempt}
        content = self._call("GET", f"/rollouts/{rollout_id}/rewards", params=params)
        return REWARDS.validate_json(content)

    def rollouts(
        self,
        status: RolloutStatus | None = None,
        group_id: str | None = None,
        task_id: str | None = None,
        limit: int | None = None,
    ) -> list[Rollout]:
        given = {"status": status, "group_id": group_id, "task_id": task_id, "limit": limit}
        params = {k: v for k, v in given.items() if v is not None}
        return ROLLOUTS.validate_json(self._call("GET", "/rollouts", params=params))

    def requeue_expired(self, now: float | None = None) -> list[Rollout]:
        return ROLLOUTS.validate_json(self._post("/requeue_expired", RequeueRequest(now=now)))

    def issue_version(self, roles: list[str]) -> int:
        return ISSUED.validate_json(self._post("/versions/issue", IssueRequest(roles=roles)))

    def publish_version(self, pv: PolicyVersion) -> None:
        self._post("/versions", pv)

    def latest_version(self, role: str = "policy") -> PolicyVersion | None:
        return VERSION.validate_json(self._call("GET", "/versions/latest", params={"role": role}))

    def counts(self) -> dict[str, int]:
        return COUNTS.validate_json(self._call("GET", "/counts"))

    def put_asset(self, name: str, text: str, note: str = "", candidate: bool = False) -> Asset:
        body = AssetRequest(name=name, text=text, note=note, candidate=candidate)
        return ASSET.validate_json(self._post("/assets", body))

    def asset(self, name: str, version: int | None = None) -> Asset:
        params = None if version is None else {"version": version}
        return ASSET.validate_json(self._call("GET", f"/assets/{quote(name)}", params=params))

    def assets(self) -> list[Asset]:
        return ASSETS.validate_json(self._call("GET", "/assets"))

    def asset_versions(self, name: str) -> list[Asset]:
        return ASSETS.validate_json(self._call("GET", f"/assets/{quote(name)}/versions"))

    def add_comparison(self, comparison: Comparison) -> None:
        self._post("/comparisons", comparison)

    def comparisons(self, name: str | None = None) -> list[Comparison]:
        params = None if name is None else {"name": name}
        return COMPARISONS.validate_json(self._call("GET", "/comparisons", params=params))

    def put_optimization(self, optimization: Optimization) -> None:
        self._post("/optimizations", optimization)

    def optimizations(self, name: str | None = None) -> list[Optimization]:
        params = None if name is None else {"name": name}
        return OPTIMIZATIONS.validate_json(self._call("GET", "/optimizations", params=params))

    def close(self) -> None:
        self._http.close()


if TYPE_CHECKING:  # mypy checks every signature against the Store protocol
    _: Store = StoreClient("")
