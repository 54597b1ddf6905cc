"""The store's HTTP surface: status codes and the JSON error shape for bad input.

The behaviours themselves are tested through StoreClient in test_store.py; here raw httpx
requests check what any other client (curl, another language) sees.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI

from tracerl.server import serving
from tracerl.store import LeaseLost, SqliteStore, StoreError
from tracerl.store.http import (
    StoreClient,
    install_error_handlers,
    store_router,
)
from tracerl.types import RolloutStatus, Task


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[httpx.Client, SqliteStore, str]]:
    store = SqliteStore()
    store.add_tasks([Task(id="t0", input={"q": 1})])
    # Mounted the way the gateway will: its own app, the store router under /store.
    app = FastAPI()
    app.include_router(store_router(store), prefix="/store")
    install_error_handlers(app)
    with serving(app) as url, httpx.Client(base_url=url) as http:
        yield http, store, url
    store.close()


@pytest.fixture
def http(served: tuple[httpx.Client, SqliteStore, str]) -> httpx.Client:
    return served[0]


def assert_error(resp: httpx.Response, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type"}
    assert body["error"]["type"] == kind and body["error"]["message"]
    return str(body["error"]["message"])


def test_unknown_rollout_is_404(http: httpx.Client) -> None:
    assert "nope" in assert_error(http.get("/store/rollouts/nope"), 404, "NotFound")
    assert_error(http.get("/store/rollouts/nope/spans"), 404, "NotFound")
    body = {"attempt": 1, "status": "succeeded"}
    assert_error(http.post("/store/rollouts/nope/finish", json=body), 404, "NotFound")


@pytest.mark.parametrize(
    "path, content",
    [
        ("/store/claim", b"{not json"),
        ("/store/claim", b'{"n": 2}'),  # runner_id missing
        ("/store/claim", b'{"runner_id": "w", "n": 0}'),
        ("/store/claim", b'{"runner_id": "w", "lease_s": "soon"}'),
        ("/store/rollouts", b'{"task_ids": "t0"}'),
        ("/store/rollouts", b'{"task_ids": ["t0"], "max_attempts": 0}'),
        ("/store/spans", b'[{"id": "s"}]'),
        ("/store/tasks", b'{"id": "t9"}'),  # a task, not a list of tasks
        ("/store/rollouts/x/finish", b'{"attempt": 1, "status": "done"}'),
        ("/store/rollouts/x/heartbeat", b""),
    ],
)
def test_malformed_body_is_422(http: httpx.Client, path: str, content: bytes) -> None:
    assert_error(http.post(path, content=content), 422, "invalid_request_error")


def test_bad_query_is_422(http: httpx.Client) -> None:
    assert "status" in assert_error(
        http.get("/store/rollouts", params={"status": "sleeping"}), 422, "invalid_request_error"
    )
    assert_error(http.get("/store/rollouts", params={"limit": -1}), 422, "invalid_request_error")


def test_lease_lost_and_finish_twice_are_409(http: httpx.Client) -> None:
    (r,) = http.post("/store/rollouts", json={"task_ids": ["t0"]}).json()
    (claimed,) = http.post("/store/claim", json={"runner_id": "w"}).json()
    assert claimed["id"] == r["id"] and claimed["attempt"] == 1
    beat = http.post(f"/store/rollouts/{r['id']}/heartbeat", json={"attempt": 2})
    assert_error(beat, 409, "LeaseLost")
    finish = {"attempt": 1, "status": "succeeded", "reward": 1.0}
    assert http.post(f"/store/rollouts/{r['id']}/finish", json=finish).json()["reward"] == 1.0
    again = http.post(f"/store/rollouts/{r['id']}/finish", json=finish)
    assert "succeeded -> succeeded" in assert_error(again, 409, "InvalidTransition")


def test_conflicting_task_is_409(http: httpx.Client) -> None:
    resp = http.post("/store/tasks", json=[{"id": "t0", "input": {"q": 2}}])
    assert_error(resp, 409, "Conflict")


def test_unknown_route_keeps_the_shape(http: httpx.Client) -> None:
    assert_error(http.get("/store/nothing-here"), 404, "invalid_request_error")
    assert_error(http.get("/store/claim"), 405, "invalid_request_error")


def test_client_raises_store_errors(served: tuple[httpx.Client, SqliteStore, str]) -> None:
    client = StoreClient(served[2] + "/store")  # a trailing /store is accepted
    with pytest.raises(LeaseLost) as caught:
        client.heartbeat(client.enqueue(["t0"])[0].id, 5)
    assert "not running" in caught.value.message
    assert client.counts()[RolloutStatus.queued] >= 1
    client.close()
    offline = StoreClient(served[2] + "/elsewhere", timeout=5)
    with pytest.raises(StoreError, match="HTTP 404"):
        offline.counts()
    offline.close()
