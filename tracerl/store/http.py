"""The store over HTTP: a FastAPI router serving any Store, and a client that is a Store.

`store_router(store)` is mounted under /store, alone (`create_store_app`) or beside the
gateway on one app. `StoreClient(url)` has the same methods and return types as
SqliteStore and raises the same StoreError subclasses, so a runner on another machine
works unchanged.

Speed: a loopback FastAPI hop costs ~0.5 ms, so the API is shaped to keep calls per rollout
low (claims are batched, spans go in one call, the final reward rides on finish) and
handlers are cheap: bodies are parsed once by pydantic-core straight from bytes, replies are
serialized by pydantic-core, and handlers run on the event loop (store calls are short
SQLite transactions; a thread-pool hop would cost more than they do).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, TypeVar

import httpx
import orjson
from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tracerl.store import (
    Conflict,
    InvalidTransition,
    LeaseLost,
    NotFound,
    Store,
    StoreError,
)
from tracerl.types import PolicyVersion, Reward, Rollout, RolloutStatus, Span, Task

__all__ = [
    "StoreClient",
    "create_store_app",
    "install_error_handlers",
    "store_router",
]

T = TypeVar("T")


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EnqueueRequest(_Body):
    """Body of POST /store/rollouts."""

    task_ids: list[str]
    """One rollout per entry; repeat an id for several rollouts of one task."""
    group_id: str | None = None
    """Group the new rollouts share."""
    max_attempts: int = Field(3, ge=1)
    """Attempts before an expiring lease times the rollout out."""


class ClaimRequest(_Body):
    """Body of POST /store/claim."""

    runner_id: str
    """Who takes the leases."""
    n: int = Field(1, ge=1, le=10_000)
    """Most rollouts to claim."""
    lease_s: float = Field(30.0, gt=0)
    """Lease length; heartbeat before it runs out."""


class HeartbeatRequest(_Body):
    """Body of POST /store/rollouts/{id}/heartbeat."""

    attempt: int
    """The attempt the caller holds."""
    lease_s: float = Field(30.0, gt=0)
    """New lease length from now."""


class FinishRequest(_Body):
    """Body of POST /store/rollouts/{id}/finish."""

    attempt: int
    """The attempt the caller holds."""
    status: RolloutStatus
    """Final status: succeeded, failed or timed_out."""
    answer: str | None = None
    """The agent's final answer."""
    reward: float | None = None
    """Final reward, also stored as a Reward record."""
    error: str | None = None
    """Why it failed."""


class RequeueRequest(_Body):
    """Body of POST /store/requeue_expired."""

    now: float | None = None
    """Clock to compare leases against; None for the server's time."""


_TASKS = TypeAdapter(list[Task])
_ROLLOUTS = TypeAdapter(list[Rollout])
_SPANS = TypeAdapter(list[Span])
_REWARDS = TypeAdapter(list[Reward])
_VERSION = TypeAdapter(PolicyVersion | None)
_COUNTS = TypeAdapter(dict[str, int])
_ENQUEUE = TypeAdapter(EnqueueRequest)
_CLAIM = TypeAdapter(ClaimRequest)
_HEARTBEAT = TypeAdapter(HeartbeatRequest)
_FINISH = TypeAdapter(FinishRequest)
_REQUEUE = TypeAdapter(RequeueRequest)
_REWARD = TypeAdapter(Reward)
_PV = TypeAdapter(PolicyVersion)

_STATUS = {NotFound: 404, InvalidTransition: 409, LeaseLost: 409, Conflict: 409}
_ERRORS: dict[str, type[StoreError]] = {c.__name__: c for c in (*_STATUS, StoreError)}


def _json(adapter: TypeAdapter[T], value: T) -> Response:
    return Response(adapter.dump_json(value), media_type="application/json")


def _one(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


async def _parse(request: Request, adapter: TypeAdapter[T]) -> T:
    """Validate the raw body once, in pydantic-core; bad input becomes a 422."""
    try:
        return adapter.validate_json(await request.body())
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_context=False)) from e


def store_router(store: Store) -> APIRouter:
    """The store API; mount it with prefix '/store' (create_store_app does)."""
    r = APIRouter()

    @r.post("/tasks", status_code=204)
    async def add_tasks(request: Request) -> Response:
        store.add_tasks(await _parse(request, _TASKS))
        return Response(status_code=204)

    @r.get("/tasks")
    async def tasks(split: str | None = None) -> Response:
        return _json(_TASKS, store.tasks(split))

    @r.get("/tasks/{task_id}")
    async def get_task(task_id: str) -> Response:
        return _one(store.get_task(task_id))

    @r.post("/rollouts")
    async def enqueue(request: Request) -> Response:
        body = await _parse(request, _ENQUEUE)
        return _json(_ROLLOUTS, store.enqueue(body.task_ids, body.group_id, body.max_attempts))

    @r.get("/rollouts")
    async def rollouts(
        status: RolloutStatus | None = None,
        group_id: str | None = None,
        task_id: str | None = None,
        limit: Annotated[int | None, Query(ge=0)] = None,
    ) -> Response:
        return _json(_ROLLOUTS, store.rollouts(status, group_id, task_id, limit))

    @r.get("/rollouts/{rollout_id}")
    async def get_rollout(rollout_id: str) -> Response:
        return _one(store.get_rollout(rollout_id))

    @r.post("/claim")
    async def claim(request: Request) -> Response:
        body = await _parse(request, _CLAIM)
        return _json(_ROLLOUTS, store.claim(body.runner_id, body.n, body.lease_s))

    @r.post("/rollouts/{rollout_id}/heartbeat")
    async def heartbeat(rollout_id: str, request: Request) -> Response:
        body = await _parse(request, _HEARTBEAT)
        return _one(store.heartbeat(rollout_id, body.attempt, body.lease_s))

    @r.post("/rollouts/{rollout_id}/finish")
    async def finish(rollout_id: str, request: Request) -> Response:
        b = await _parse(request, _FINISH)
        return _one(store.finish(rollout_id, b.attempt, b.status, b.answer, b.reward, b.error))

    @r.post("/spans", status_code=204)
    async def add_spans(request: Request) -> Response:
        store.add_spans(await _parse(request, _SPANS))
        return Response(status_code=204)

    @r.get("/rollouts/{rollout_id}/spans")
    async def spans(rollout_id: str, attempt: int | None = None) -> Response:
        return _json(_SPANS, store.spans(rollout_id, attempt))

    @r.post("/rewards", status_code=204)
    async def add_reward(request: Request) -> Response:
        store.add_reward(await _parse(request, _REWARD))
        return Response(status_code=204)

    @r.get("/rollouts/{rollout_id}/rewards")
    async def rewards(rollout_id: str, attempt: int | None = None) -> Response:
        return _json(_REWARDS, store.rewards(rollout_id, attempt))

    @r.post("/requeue_expired")
    async def requeue_expired(request: Request) -> Response:
        body = await _parse(request, _REQUEUE)
        return _json(_ROLLOUTS, store.requeue_expired(body.now))

    @r.post("/versions", status_code=204)
    async def publish_version(request: Request) -> Response:
        store.publish_version(await _parse(request, _PV))
        return Response(status_code=204)

    @r.get("/versions/latest")
    async def latest_version(role: str = "policy") -> Response:
        return _json(_VERSION, store.latest_version(role))

    @r.get("/counts")
    async def counts() -> Response:
        return _json(_COUNTS, store.counts())

    return r


# -- errors as JSON -----------------------------------------------------------------------


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


async def _store_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StoreError)
    return _error(_STATUS.get(type(exc), 400), type(exc).__name__, exc.message)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    parts = [
        f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors()
    ]
    return _error(422, "invalid_request_error", "; ".join(parts) or "invalid request")


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return _error(exc.status_code, "invalid_request_error", str(exc.detail))


def install_error_handlers(app: FastAPI) -> None:
    """Turn StoreErrors (404/409), bad requests (422) and HTTP errors (unknown route, wrong
    method) into `{"error": {"message", "type"}}` JSON, never a 500 with a traceback."""
    app.add_exception_handler(StoreError, _store_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


def create_store_app(store: Store) -> FastAPI:
    """A standalone app serving `store` under /store."""
    app = FastAPI(title="tracerl store")
    app.include_router(store_router(store), prefix="/store")
    install_error_handlers(app)
    return app


# -- client -------------------------------------------------------------------------------


def _raise_for(resp: httpx.Response) -> None:
    """Raise the StoreError subclass named in the error JSON (StoreError for anything else)."""
    try:
        err = orjson.loads(resp.content)["error"]
        kind, message = str(err["type"]), str(err["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        kind, message = "", resp.text
    if kind in _ERRORS:
        raise _ERRORS[kind](message)
    raise StoreError(f"HTTP {resp.status_code} ({kind or 'no error type'}): {message}")


class StoreClient:
    """A Store reached over HTTP; thread-safe, one keep-alive connection pool."""

    def __init__(self, base_url: str, timeout: float = 30.0) -> None:
        """`base_url` is the server root (http://host:port); a trailing /store is accepted."""
        root = base_url.rstrip("/").removesuffix("/store")
        self._http = httpx.Client(base_url=f"{root}/store", timeout=timeout)

    def _call(
        self,
        method: str,
        path: str,
        content: bytes | None = None,
        params: Mapping[str, str | int] | None = None,
    ) -> bytes:
        headers = {"content-type": "application/json"} if content is not None else None
        resp = self._http.request(method, path, content=content, params=params, headers=headers)
        if resp.status_code >= 400:
            _raise_for(resp)
        return resp.content

    def _post(self, path: str, body: BaseModel) -> bytes:
        return self._call("POST", path, body.model_dump_json().encode())

    def add_tasks(self, tasks: list[Task]) -> None:
        self._call("POST", "/tasks", _TASKS.dump_json(tasks))

    def get_task(self, task_id: str) -> Task:
        return Task.model_validate_json(self._call("GET", f"/tasks/{task_id}"))

    def tasks(self, split: str | None = None) -> list[Task]:
        params = None if split is None else {"split": split}
        return _TASKS.validate_json(self._call("GET", "/tasks", params=params))

    def enqueue(
        self, task_ids: list[str], group_id: str | None = None, max_attempts: int = 3
    ) -> list[Rollout]:
        body = EnqueueRequest(task_ids=task_ids, group_id=group_id, max_attempts=max_attempts)
        return _ROLLOUTS.validate_json(self._post("/rollouts", body))

    def claim(self, runner_id: str, n: int = 1, lease_s: float = 30.0) -> list[Rollout]:
        body = ClaimRequest(runner_id=runner_id, n=n, lease_s=lease_s)
        return _ROLLOUTS.validate_json(self._post("/claim", body))

    def heartbeat(self, rollout_id: str, attempt: int, lease_s: float = 30.0) -> Rollout:
        body = HeartbeatRequest(attempt=attempt, lease_s=lease_s)
        return Rollout.model_validate_json(self._post(f"/rollouts/{rollout_id}/heartbeat", body))

    def get_rollout(self, rollout_id: str) -> Rollout:
        return Rollout.model_validate_json(self._call("GET", f"/rollouts/{rollout_id}"))

    def add_span(self, span: Span) -> None:
        self.add_spans([span])

    def add_spans(self, spans: list[Span]) -> None:
        self._call("POST", "/spans", _SPANS.dump_json(spans))

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
        return Rollout.model_validate_json(self._post(f"/rollouts/{rollout_id}/finish", body))

    def spans(self, rollout_id: str, attempt: int | None = None) -> list[Span]:
        params = None if attempt is None else {"attempt": attempt}
        return _SPANS.validate_json(
            self._call("GET", f"/rollouts/{rollout_id}/spans", params=params)
        )

    def rewards(self, rollout_id: str, attempt: int | None = None) -> list[Reward]:
        params = None if attempt is None else {"attempt": attempt}
        content = self._call("GET", f"/rollouts/{rollout_id}/rewards", params=params)
        return _REWARDS.validate_json(content)

    def rollouts(
        self,
        status: RolloutStatus | None = None,
        group_id: str | None = None,
        task_id: str | None = None,
        limit: int | None = None,
    ) -> list[Rollout]:
        given = {"status": status, "group_id": group_id, "task_id": task_id, "limit": limit}
        params = {k: v for k, v in given.items() if v is not None}
        return _ROLLOUTS.validate_json(self._call("GET", "/rollouts", params=params))

    def requeue_expired(self, now: float | None = None) -> list[Rollout]:
        return _ROLLOUTS.validate_json(self._post("/requeue_expired", RequeueRequest(now=now)))

    def publish_version(self, pv: PolicyVersion) -> None:
        self._post("/versions", pv)

    def latest_version(self, role: str = "policy") -> PolicyVersion | None:
        return _VERSION.validate_json(self._call("GET", "/versions/latest", params={"role": role}))

    def counts(self) -> dict[str, int]:
        return _COUNTS.validate_json(self._call("GET", "/counts"))

    def close(self) -> None:
        self._http.close()


if TYPE_CHECKING:  # mypy checks every signature against the Store protocol
    _: Store = StoreClient("")
