"""The store's HTTP surface: status codes and the JSON error shape for bad input.

The behaviours themselves are tested through StoreClient in test_store.py; here raw httpx
requests check what any other client (curl, another language) sees.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI

from tracerl.limits import Limits
from tracerl.server import serving
from tracerl.store import LeaseLost, SqliteStore, StoreError
from tracerl.store.http import (
    StoreClient,
    create_store_app,
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
    json = {"content-type": "application/json"}
    assert_error(http.post(path, content=content, headers=json), 422, "invalid_request_error")


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


HUGE = 90562371220467374620672  # past SQLite's 64-bit INTEGER


@pytest.mark.parametrize(
    "path, params",
    [
        ("/store/rollouts/x/rewards", {"attempt": HUGE}),
        ("/store/rollouts/x/spans", {"attempt": 2**63}),
        ("/store/rollouts/x/spans", {"attempt": 2**31}),
        ("/store/rollouts/x/spans", {"attempt": -1}),
        ("/store/rollouts", {"limit": HUGE}),
        ("/store/rollouts", {"limit": 100_001}),
        ("/store/rollouts", {"limit": 0}),
    ],
)
def test_out_of_range_query_integers_are_422(
    http: httpx.Client, path: str, params: dict[str, int]
) -> None:
    (name,) = params
    message = assert_error(http.get(path, params=params), 422, "invalid_request_error")
    assert name in message


def _span_body(**changes: object) -> dict[str, object]:
    span = {
        "id": "s", "rollout_id": "x", "attempt": 1, "seq": 0, "role": "policy",
        "policy_version": 0, "prompt_ids": [1, 2], "completion_ids": [3], "logprobs": [-0.5],
        "messages": [], "response": {}, "finish_reason": "stop", "temperature": 1.0,
        "latency_s": 0.0,
    }  # fmt: skip
    return span | changes


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/store/rollouts/x/heartbeat", {"attempt": HUGE}, "attempt"),
        ("/store/rollouts/x/finish", {"attempt": 2**63, "status": "failed"}, "attempt"),
        ("/store/rollouts", {"task_ids": ["t0"], "max_attempts": 2**63}, "max_attempts"),
        ("/store/rewards", {"rollout_id": "x", "attempt": 2**40, "value": 1.0}, "attempt"),
        (
            "/store/rewards",
            {"rollout_id": "x", "attempt": 1, "value": 1, "span_seq": HUGE},
            "span_seq",
        ),
        ("/store/spans", [_span_body(seq=2**63)], "seq"),
        ("/store/spans", [_span_body(prompt_ids=[1, 2**40])], "prompt_ids"),
        ("/store/spans", [_span_body(messages=[{"role": "user", "n": HUGE}])], "messages"),
        ("/store/tasks", [{"id": "big", "input": {"q": HUGE}}], "input"),
        ("/store/versions", {"role": "policy", "version": 2**63, "path": "p"}, "version"),
    ],
)
def test_out_of_range_body_integers_are_422(
    http: httpx.Client, path: str, body: object, field: str
) -> None:
    assert field in assert_error(http.post(path, json=body), 422, "invalid_request_error")


def test_large_integers_within_bounds_are_served(http: httpx.Client) -> None:
    # A task's own numbers are payload: 64 bits are fine.
    task = {"id": "big-answer", "input": {"q": 10**15}, "answer": -(2**62)}
    assert http.post("/store/tasks", json=[task]).status_code == 204
    assert http.get("/store/tasks/big-answer").json()["answer"] == -(2**62)
    last = {"attempt": 2**31 - 1}
    assert http.get("/store/rollouts/nope/spans", params=last).json() == []
    assert http.get("/store/rollouts", params={"limit": 100_000}).status_code == 200


@pytest.mark.parametrize(
    "path, body",
    [
        ("/store/claim", {"runner_id": "w", "lease_s": 1e300}),
        ("/store/rollouts/x/heartbeat", {"attempt": 1, "lease_s": 1e300}),
        ("/store/sessions", {"key": "k", "lease_s": 1e300}),
    ],
)
def test_leases_past_the_bound_are_422(http: httpx.Client, path: str, body: object) -> None:
    """Regression: lease_s = 1e300 was accepted, so a dead runner's rollout was never
    re-queued."""
    message = assert_error(http.post(path, json=body), 422, "invalid_request_error")
    assert "lease_s" in message and "3600" in message


def test_the_lease_bound_is_configured_and_a_refusal_changes_nothing() -> None:
    store = SqliteStore()
    store.add_tasks([Task(id="t0", input={"q": 1})])
    store.enqueue(["t0"])
    app = create_store_app(store, limits=Limits(max_lease_s=60))
    with serving(app) as url, httpx.Client(base_url=url) as http:
        refused = http.post("/store/claim", json={"runner_id": "w", "lease_s": 61})
        assert "60" in assert_error(refused, 422, "invalid_request_error")
        assert store.counts()["queued"] == 1  # nothing claimed
        (claimed,) = http.post("/store/claim", json={"runner_id": "w", "lease_s": 60}).json()
        beat = {"attempt": 1, "lease_s": 61}
        assert_error(http.post(f"/store/rollouts/{claimed['id']}/heartbeat", json=beat), 422,
                     "invalid_request_error")  # fmt: skip
        expires = store.get_rollout(claimed["id"]).lease_expires_at
        assert expires is not None and expires <= claimed["lease_expires_at"]
    store.close()


@pytest.mark.parametrize(
    "where, content",
    [
        ("finish", b'{"attempt": 1, "status": "succeeded", "reward": 1e308}'),
        ("finish", b'{"attempt": 1, "status": "succeeded", "reward": 1e999}'),
        ("rewards", b'{"rollout_id": "ID", "attempt": 1, "value": -1e308}'),
        ("rewards", b'{"rollout_id": "ID", "attempt": 1, "value": 1e999}'),
        ("rewards", b'{"rollout_id": "ID", "attempt": 1, "value": NaN}'),
    ],
)
def test_absurd_and_non_finite_rewards_are_422_and_not_stored(
    served: tuple[httpx.Client, SqliteStore, str], where: str, content: bytes
) -> None:
    """Regression: a reward of 1e308 was stored, and GRPO over it raised OverflowError."""
    http, store, _ = served
    store.enqueue(["t0"])
    (claimed,) = store.claim("w", 1)  # the oldest queued: earlier tests leave some behind
    path = f"/store/rollouts/{claimed.id}/finish" if where == "finish" else "/store/rewards"
    resp = http.post(path, content=content.replace(b"ID", claimed.id.encode()))
    message = assert_error(resp, 422, "invalid_request_error")
    assert "reward" in message or "value" in message
    assert store.rewards(claimed.id) == []
    assert store.get_rollout(claimed.id).status is RolloutStatus.running
    within = {"attempt": claimed.attempt, "status": "succeeded", "reward": -1e6}
    assert http.post(f"/store/rollouts/{claimed.id}/finish", json=within).status_code == 200
