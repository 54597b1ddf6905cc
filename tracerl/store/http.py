"""The store over HTTP: a FastAPI router serving any Store, and its JSON errors.

`store_router(store)` is mounted under /store, alone (`create_store_app`) or beside the
gateway on one app. `StoreClient` (client.py, re-exported here) is a Store that calls it.

Speed: a loopback FastAPI hop costs ~0.5 ms, so the API is shaped to keep calls per rollout
low (claims are batched, spans go in one call, the final reward rides on finish) and
handlers are cheap: bodies are parsed once by pydantic-core straight from bytes and replies
are serialized by pydantic-core.

The event loop never waits on the store: every store call runs on a worker thread (the
executor the owner passes; the loop's default one otherwise). A store call is usually a
short SQLite transaction, but a span with a 10 MB message, a slow disk or another process
holding the file's write lock would otherwise stall every request on the loop, /health
included. The Store itself serialises its threads (see sqlite.py).

Every integer a request carries is bounded (wire.py): out of range is a 422, never a 500.
So are rewards (finite, within types.REWARD_LIMIT) and leases (at most the service's
`Limits.max_lease_s`: a runner that dies holding a longer lease would keep its rollout
from being re-queued for that long).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tracerl.assets.records import Asset, Comparison, Optimization
from tracerl.auth import Keys
from tracerl.doors import guard_app
from tracerl.limits import Limits
from tracerl.refusals import allowed_methods
from tracerl.store import Store, StoreError
from tracerl.store.client import StoreClient
from tracerl.store.sessions import SessionRequest
from tracerl.store.wire import (
    ASSET,
    ASSETS,
    ATTEMPT_MAX,
    CLAIM,
    CLAIMED,
    COMPARISON,
    COMPARISONS,
    COUNTS,
    ENQUEUE,
    FINISH,
    HEARTBEAT,
    ISSUE,
    ISSUED,
    LIMIT_MAX,
    OPTIMIZATION,
    OPTIMIZATIONS,
    PAYLOAD,
    PAYLOAD_SCHEMA,
    PUT_ASSET,
    PV,
    REQUEUE,
    REWARD,
    REWARDS,
    ROLLOUTS,
    SEQS,
    SPANS,
    STATUS,
    TASKS,
    VERSION,
    Claimed,
    body_doc,
    errors_doc,
    out_of_range,
    validate_strictly,
)
from tracerl.types import PolicyVersion, Reward, Rollout, RolloutStatus, Span, Task

__all__ = [
    "StoreClient",
    "create_store_app",
    "document",
    "install_error_handlers",
    "store_router",
]

T = TypeVar("T")

SESSION = TypeAdapter(SessionRequest)

Attempt = Annotated[int | None, Query(ge=0, lt=ATTEMPT_MAX)]
"""An attempt number in a query string; absent means the rollout's current attempt."""
Limit = Annotated[int | None, Query(ge=1, le=LIMIT_MAX)]
"""Most rows a listing returns; absent means all."""
Version = Annotated[int | None, Query(ge=1, lt=ATTEMPT_MAX)]
"""An asset version in a query string; absent means the current one."""


def _json(adapter: TypeAdapter[T], value: T) -> Response:
    return Response(adapter.dump_json(value), media_type="application/json")


def _one(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _check_lease(lease_s: float, limits: Limits) -> None:
    """A 422 naming the bound when a lease is longer than the service allows."""
    if lease_s > limits.max_lease_s:
        message = f"must be at most {limits.max_lease_s:g} seconds (limits.max_lease_s)"
        raise RequestValidationError([{"loc": ("body", "lease_s"), "msg": message}])


async def _parse(request: Request, adapter: TypeAdapter[T]) -> T:
    """Validate the raw body once, in pydantic-core; bad input (out-of-range numbers
    included) becomes a 422."""
    try:
        value = validate_strictly(adapter, await request.body())
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_context=False)) from e
    if error := out_of_range(value):
        raise RequestValidationError([error])
    return value


def document(app: FastAPI) -> None:
    """Add the components the store's bodies refer to (store.wire.PAYLOAD) to `app`'s
    OpenAPI document, once it is built."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = build()
            doc.setdefault("components", {}).setdefault("schemas", {})[PAYLOAD] = PAYLOAD_SCHEMA
        return app.openapi_schema or build()

    app.openapi = openapi  # type: ignore[method-assign]


def store_router(
    store: Store,
    executor: Executor | None = None,
    keys: Keys | None = None,
    on_finish: Callable[[Rollout], None] | None = None,
    limits: Limits | None = None,
) -> APIRouter:
    """The store API; mount it with prefix '/store' (create_store_app does).

    Store calls run on `executor` (None: the event loop's default executor). `keys` mints
    each claimed attempt's agent key (a random secret when None); who may call what is
    the app's guard (tracerl.auth), not the router's. `on_finish` is told of each attempt
    finished through the API, on the event loop (the gateway drops what it remembers).
    `limits.max_lease_s` bounds the leases a claim, heartbeat or session asks for."""
    # Every store route may answer 422 in the store's error shape (FastAPI's default entry
    # describes its own shape, which this API never sends).
    r = APIRouter(responses=errors_doc(422))
    keys = keys or Keys()
    limits = limits or Limits()

    def doc(adapter: TypeAdapter[Any]) -> dict[str, Any]:
        """A body's OpenAPI entry: its numbers bounded as out_of_range holds them, its lease
        (if it asks for one) as _check_lease does."""
        return body_doc(adapter, store=True, maxima={"lease_s": limits.max_lease_s})

    async def call(fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, functools.partial(fn, *args))

    @r.post("/tasks", status_code=204, responses=errors_doc(409, 422), openapi_extra=doc(TASKS))
    async def add_tasks(request: Request) -> Response:
        await call(store.add_tasks, await _parse(request, TASKS))
        return Response(status_code=204)

    @r.get("/tasks", response_model=list[Task], responses=errors_doc(422))
    async def tasks(split: str | None = None) -> Response:
        return _json(TASKS, await call(store.tasks, split))

    @r.get("/tasks/{task_id}", response_model=Task, responses=errors_doc(404))
    async def get_task(task_id: str) -> Response:
        return _one(await call(store.get_task, task_id))

    @r.post(
        "/rollouts",
        response_model=list[Rollout],
        responses=errors_doc(404, 422),
        openapi_extra=doc(ENQUEUE),
    )
    async def enqueue(request: Request) -> Response:
        b = await _parse(request, ENQUEUE)
        args = (b.task_ids, b.group_id, b.max_attempts, b.assets, b.seeds)
        return _json(ROLLOUTS, await call(store.enqueue, *args))

    @r.get("/rollouts", response_model=list[Rollout], responses=errors_doc(422))
    async def rollouts(
        status: RolloutStatus | None = None,
        group_id: str | None = None,
        task_id: str | None = None,
        limit: Limit = None,
    ) -> Response:
        return _json(ROLLOUTS, await call(store.rollouts, status, group_id, task_id, limit))

    @r.get("/rollouts/{rollout_id}", response_model=Rollout, responses=errors_doc(404))
    async def get_rollout(rollout_id: str) -> Response:
        return _one(await call(store.get_rollout, rollout_id))

    @r.post(
        "/claim",
        response_model=list[Claimed],
        responses=errors_doc(422),
        openapi_extra=doc(CLAIM),
    )
    async def claim(request: Request) -> Response:
        b = await _parse(request, CLAIM)
        _check_lease(b.lease_s, limits)
        # A runner key claims under the runner id it is bound to, whatever the body says:
        # that id is what heartbeats and finishes are checked against.
        runner_id = _bound_runner(request) or b.runner_id
        claimed = await call(store.claim, runner_id, b.n, b.lease_s)
        return _json(CLAIMED, [_with_key(rollout, keys) for rollout in claimed])

    @r.post(
        "/rollouts/{rollout_id}/heartbeat",
        response_model=Rollout,
        responses=errors_doc(404, 409, 422),
        openapi_extra=doc(HEARTBEAT),
    )
    async def heartbeat(rollout_id: str, request: Request) -> Response:
        b = await _parse(request, HEARTBEAT)
        _check_lease(b.lease_s, limits)
        return _one(await call(store.heartbeat, rollout_id, b.attempt, b.lease_s))

    @r.post(
        "/sessions",
        response_model=Rollout,
        responses=errors_doc(422),
        openapi_extra=doc(SESSION),
    )
    async def open_session(request: Request) -> Response:
        b = await _parse(request, SESSION)
        _check_lease(b.lease_s, limits)
        return _one(await call(store.open_session, b.key, b.lease_s))

    @r.post(
        "/rollouts/{rollout_id}/finish",
        response_model=Rollout,
        responses=errors_doc(404, 409, 422),
        openapi_extra=doc(FINISH),
    )
    async def finish(rollout_id: str, request: Request) -> Response:
        b = await _parse(request, FINISH)
        args = (rollout_id, b.attempt, b.status, b.answer, b.reward, b.error)
        rollout = await call(store.finish, *args)
        if on_finish is not None:
            on_finish(rollout)
        return _one(rollout)

    @r.post(
        "/spans",
        status_code=204,
        responses=errors_doc(404, 409, 422),
        openapi_extra=doc(SPANS),
    )
    async def add_spans(request: Request) -> Response:
        await call(store.add_spans, await _parse(request, SPANS))
        return Response(status_code=204)

    @r.post(
        "/spans/append",
        response_model=list[int],
        responses=errors_doc(404, 409, 422),
        openapi_extra=doc(SPANS),
    )
    async def append_spans(request: Request) -> Response:
        return _json(SEQS, await call(store.append_spans, await _parse(request, SPANS)))

    @r.get(
        "/rollouts/{rollout_id}/spans", response_model=list[Span], responses=errors_doc(404, 422)
    )
    async def spans(rollout_id: str, attempt: Attempt = None) -> Response:
        return _json(SPANS, await call(store.spans, rollout_id, attempt))

    @r.post(
        "/rewards",
        status_code=204,
        responses=errors_doc(404, 409, 422),
        openapi_extra=doc(REWARD),
    )
    async def add_reward(request: Request) -> Response:
        await call(store.add_reward, await _parse(request, REWARD))
        return Response(status_code=204)

    @r.get(
        "/rollouts/{rollout_id}/rewards",
        response_model=list[Reward],
        responses=errors_doc(404, 422),
    )
    async def rewards(rollout_id: str, attempt: Attempt = None) -> Response:
        return _json(REWARDS, await call(store.rewards, rollout_id, attempt))

    @r.post(
        "/requeue_expired",
        response_model=list[Rollout],
        responses=errors_doc(422),
        openapi_extra=doc(REQUEUE),
    )
    async def requeue_expired(request: Request) -> Response:
        body = await _parse(request, REQUEUE)
        return _json(ROLLOUTS, await call(store.requeue_expired, body.now))

    @r.post("/versions", status_code=204, responses=errors_doc(409, 422), openapi_extra=doc(PV))
    async def publish_version(request: Request) -> Response:
        await call(store.publish_version, await _parse(request, PV))
        return Response(status_code=204)

    @r.post(
        "/versions/issue", response_model=int, responses=errors_doc(422),
        openapi_extra=doc(ISSUE),
    )  # fmt: skip
    async def issue_version(request: Request) -> Response:
        b = await _parse(request, ISSUE)
        return _json(ISSUED, await call(store.issue_version, b.roles))

    @r.get("/versions/latest", response_model=PolicyVersion | None, responses=errors_doc(422))
    async def latest_version(role: str = "policy") -> Response:
        return _json(VERSION, await call(store.latest_version, role))

    @r.get("/counts", response_model=dict[str, int])
    async def counts() -> Response:
        return _json(COUNTS, await call(store.counts))

    _asset_routes(r, store, call)
    return r


Call = Callable[..., Any]
"""The router's `call`: a store method run off the event loop."""


def _asset_routes(r: APIRouter, store: Store, call: Call) -> None:
    """Assets (versioned texts), their comparisons and optimizations."""

    @r.post(
        "/assets", response_model=Asset, responses=errors_doc(422),
        openapi_extra=body_doc(PUT_ASSET, store=True),
    )  # fmt: skip
    async def put_asset(request: Request) -> Response:
        b = await _parse(request, PUT_ASSET)
        return _one(await call(store.put_asset, b.name, b.text, b.note, b.candidate))

    @r.get("/assets", response_model=list[Asset])
    async def assets() -> Response:
        return _json(ASSETS, await call(store.assets))

    @r.get("/assets/{name}", response_model=Asset, responses=errors_doc(404, 422))
    async def asset(name: str, version: Version = None) -> Response:
        return _json(ASSET, await call(store.asset, name, version))

    @r.get("/assets/{name}/versions", response_model=list[Asset], responses=errors_doc(404))
    async def asset_versions(name: str) -> Response:
        return _json(ASSETS, await call(store.asset_versions, name))

    @r.post(
        "/comparisons", status_code=204, responses=errors_doc(409, 422),
        openapi_extra=body_doc(COMPARISON, store=True),
    )  # fmt: skip
    async def add_comparison(request: Request) -> Response:
        await call(store.add_comparison, await _parse(request, COMPARISON))
        return Response(status_code=204)

    @r.get("/comparisons", response_model=list[Comparison], responses=errors_doc(422))
    async def comparisons(name: str | None = None) -> Response:
        return _json(COMPARISONS, await call(store.comparisons, name))

    @r.post(
        "/optimizations", status_code=204, responses=errors_doc(409, 422),
        openapi_extra=body_doc(OPTIMIZATION, store=True),
    )  # fmt: skip
    async def put_optimization(request: Request) -> Response:
        await call(store.put_optimization, await _parse(request, OPTIMIZATION))
        return Response(status_code=204)

    @r.get("/optimizations", response_model=list[Optimization], responses=errors_doc(422))
    async def optimizations(name: str | None = None) -> Response:
        return _json(OPTIMIZATIONS, await call(store.optimizations, name))


def _bound_runner(request: Request) -> str | None:
    """The runner id the caller's runner key is bound to (None for any other caller)."""
    principal = getattr(request.state, "principal", None)
    return principal.runner_id if principal is not None else None


def _with_key(rollout: Rollout, keys: Keys) -> Claimed:
    key = keys.agent_key(rollout.id, rollout.attempt)
    return Claimed.model_construct(**dict(rollout), agent_key=key)


# -- errors as JSON -----------------------------------------------------------------------


def _error(
    status: int, kind: str, message: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _store_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StoreError)
    return _error(STATUS.get(type(exc), 400), type(exc).__name__, exc.message)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    parts = [
        f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors()
    ]
    return _error(422, "invalid_request_error", "; ".join(parts) or "invalid request")


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    headers = dict(exc.headers or {})
    if exc.status_code == 405:  # every method the path takes, not only one route's
        headers["Allow"] = allowed_methods(request, headers.get("Allow", ""))
    return _error(exc.status_code, "invalid_request_error", str(exc.detail), headers)


def install_error_handlers(app: FastAPI) -> None:
    """Turn StoreErrors (404/409), bad requests (422) and HTTP errors (unknown route, wrong
    method) into `{"error": {"message", "type"}}` JSON, never a 500 with a traceback (refused
    keys are the middleware's: guard_app)."""
    app.add_exception_handler(StoreError, _store_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


def create_store_app(
    store: Store,
    executor: Executor | None = None,
    keys: Keys | None = None,
    limits: Limits | None = None,
) -> FastAPI:
    """A standalone app serving `store` under /store (store calls on `executor`), behind
    `keys` (none: open, to loopback Host names only) and `limits`."""
    keys = keys or Keys()
    app = FastAPI(title="tracerl store", responses=errors_doc(401, 403, 408, 413, 415))
    limits = limits or Limits()
    app.include_router(store_router(store, executor, keys, limits=limits), prefix="/store")
    install_error_handlers(app)
    document(app)
    guard_app(app, keys, limits, store, executor)
    return app
