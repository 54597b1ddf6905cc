"""The dashboard's HTTP side: the page (static files) and the JSON API it polls.

Read endpoints take the run's name and read its files (tracerl.dashboard.runs) and its
store (tracerl.dashboard.queries, read-only). The control endpoint appends a command to the
run's control.jsonl (tracerl.pipeline.control_files); the training loop applies it between
steps. Control needs `Authorization: Bearer <TRACERL_ADMIN_KEY>` when that key is set, and
is open without a key only to loopback clients. Whatever the key, the page answers to
loopback Host names only and refuses other pages' Origins and non-JSON bodies
(tracerl.doors): a web page the user opens can neither steer a run nor read it.

Every error is JSON, {"error": {"message", "type"}}, with a 4xx status for bad input (an
unknown run or rollout, a bad filter, a refused setting) and 503 for a store that cannot be
read right now; never a traceback.
"""

from __future__ import annotations

import hmac
import os
import sqlite3
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from tracerl.algorithms.config import AlgorithmConfig
from tracerl.dashboard.assets import install_asset_routes
from tracerl.dashboard.config import is_loopback
from tracerl.dashboard.queries import Health, Page, RolloutFilter, RunStore
from tracerl.dashboard.runs import MetricsChunk, Runs, RunStatus, RunSummary
from tracerl.dashboard.traceview import Decoder, TraceView, trace_view
from tracerl.doors import DoorsMiddleware
from tracerl.pipeline.control_files import Command, Op, is_live, read_state, send
from tracerl.store.wire import body_doc

__all__ = ["ApiError", "ControlRequest", "create_app"]

STATIC = Path(__file__).parent / "static"
"""The page: index.html, app.js, style.css and the vendored uPlot chart library."""


class ApiError(Exception):
    """A refused request: its HTTP status and a message for the page."""

    def __init__(self, status: int, message: str, type: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type


class ControlRequest(BaseModel):
    """The body of POST /api/runs/<run>/control."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    op: Op
    """pause, resume, checkpoint, stop or set."""
    key: str | None = Field(default=None, max_length=200)
    """For set: the setting (trainer.lr, pipeline.group_size, curation.*)."""
    value: JsonValue = None
    """For set: the new value."""


def _error(status: int, message: str, type: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type}}, status_code=status)


def _install_errors(app: FastAPI) -> None:
    """Every failure as JSON with a status code."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return _error(e.status, e.message, e.type)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail), "not_found" if e.status_code == 404 else "http")

    @app.exception_handler(RequestValidationError)
    async def bad_input(request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"] if p not in ("query", "body", "path"))
        return _error(400, f"{where}: {err['msg']}" if where else err["msg"], "invalid_request")

    @app.exception_handler(sqlite3.Error)
    async def store_error(request: Request, e: sqlite3.Error) -> JSONResponse:
        return _error(503, f"the run's store cannot be read now: {e}", "store_unavailable")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        return _error(500, f"{type(e).__name__}: {e}", "internal_error")


def create_app(runs_root: str | Path, admin_key: str | None = None) -> FastAPI:
    """The dashboard over the runs in `runs_root`; `admin_key` (default:
    $TRACERL_ADMIN_KEY; "" for none) guards the control endpoint."""
    key = (admin_key if admin_key is not None else os.environ.get("TRACERL_ADMIN_KEY")) or None
    runs = Runs(Path(runs_root))
    app = FastAPI(title="tracerl dashboard", docs_url=None, redoc_url=None)
    # It listens on loopback only (DashboardCommand): a web page may neither steer it (a
    # foreign Origin, a text/plain body) nor read it by DNS rebinding (a foreign Host).
    app.add_middleware(DoorsMiddleware)
    _install_errors(app)
    _page_routes(app, key)
    _run_routes(app, runs)
    _rollout_routes(app, runs)
    _control_routes(app, runs, key)
    install_asset_routes(app, lambda run: _store(runs, run).path, ApiError)
    return app


def _run_dir(runs: Runs, run: str) -> Path:
    try:
        return runs.dir(run)
    except KeyError:
        raise ApiError(404, f"no run {run!r} in {runs.root}", "not_found") from None


def _store(runs: Runs, run: str) -> RunStore:
    path = _run_dir(runs, run) / "traces.db"
    if not path.exists():
        raise ApiError(404, f"run {run!r} has no traces.db yet", "not_found")
    return RunStore(path)


def _page_routes(app: FastAPI, key: str | None) -> None:
    """The page, its files, and whether it must ask for the admin key."""
    files = _static_files()

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return files["index.html"]

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in files:
            raise ApiError(404, f"no file {name!r}", "not_found")
        return files[name]

    @app.get("/api/auth")
    def auth() -> dict[str, bool]:
        """Whether control needs the admin key (the page then asks for it)."""
        return {"required": key is not None}


def _run_routes(app: FastAPI, runs: Runs) -> None:
    """The runs list, and each run's config, metrics, status and health."""

    @app.get("/api/runs")
    def list_runs() -> dict[str, list[RunSummary]]:
        return {"runs": [runs.summary(name) for name in runs.names()]}

    @app.get("/api/runs/{run}/config")
    def config(run: str) -> dict[str, Any]:
        _run_dir(runs, run)
        cfg = runs.config(run)
        if cfg is None:
            raise ApiError(404, f"run {run!r} has no readable config.json", "not_found")
        return cfg.model_dump()

    @app.get("/api/runs/{run}/metrics")
    def metrics(run: str, since: Annotated[int, Query(ge=0)] = 0) -> MetricsChunk:
        _run_dir(runs, run)
        return runs.metrics(run, since)

    @app.get("/api/runs/{run}/status")
    def status(run: str) -> RunStatus:
        _run_dir(runs, run)
        return runs.status(run)

    @app.get("/api/runs/{run}/health")
    def health(run: str) -> Health:
        return _store(runs, run).health()


def _rollout_routes(app: FastAPI, runs: Runs) -> None:
    """The rollouts table and the trace view."""

    @app.get("/api/runs/{run}/rollouts")
    def rollouts(run: str, f: Annotated[RolloutFilter, Query()]) -> Page:
        return _store(runs, run).page(f, runs.steps(run))

    @app.get("/api/runs/{run}/rollouts/{rollout_id}")
    def rollout(run: str, rollout_id: str) -> TraceView:
        store = _store(runs, run)
        cfg = runs.config(run)

        def decoder(role: str) -> Decoder | None:
            return Decoder.load(runs.tokenizer_file(run, role))

        algorithm = (cfg.algorithm if cfg else AlgorithmConfig()).build()
        step = runs.steps(run).get(rollout_id)
        try:
            return trace_view(store, rollout_id, decoder, algorithm, step)
        except KeyError:
            raise ApiError(404, f"no rollout {rollout_id!r} in run {run!r}", "not_found") from None


def _control_routes(app: FastAPI, runs: Runs, key: str | None) -> None:
    """Commands to a run's training loop, behind the admin key when one is set."""

    def authorize(request: Request) -> None:
        if key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                raise ApiError(401, "control needs Authorization: Bearer <admin key>", "auth")
        elif request.client is None or not is_loopback(request.client.host):
            raise ApiError(403, "control without an admin key is open to loopback only", "auth")

    # The handler reads its body itself, so the key is checked before a byte of it is read
    # (FastAPI reads a declared body before it runs the route's dependencies).
    @app.post(
        "/api/runs/{run}/control",
        status_code=202,
        dependencies=[Depends(authorize)],
        openapi_extra=body_doc(TypeAdapter(ControlRequest)),
    )
    async def control(run: str, request: Request) -> dict[str, Any]:
        try:
            body = ControlRequest.model_validate_json(await request.body())
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False)) from None
        return await run_in_threadpool(_control, runs, run, body)


def _control(runs: Runs, run: str, body: ControlRequest) -> dict[str, Any]:
    """Append the command to the run's control file (file I/O: on a worker thread)."""
    path = _run_dir(runs, run)
    try:
        cmd: Command = send(path, body.op, body.key, body.value, origin="dashboard")
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    return {"command": cmd.model_dump(), "live": is_live(read_state(path))}


_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def _static_files() -> dict[str, Response]:
    """The page's files, read once: served from memory (async, no file I/O per request),
    so a first visit costs no thread hops on a busy machine."""
    return {
        path.name: Response(
            path.read_bytes(),
            media_type=_TYPES.get(path.suffix, "text/plain") + "; charset=utf-8",
            headers={"cache-control": "no-cache"},  # revalidated: a new version shows at once
        )
        for path in STATIC.iterdir()
        if path.is_file()
    }
