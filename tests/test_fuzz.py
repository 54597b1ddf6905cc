"""The OpenAPI document is the contract, and the service keeps it.

Schemathesis runs every check (`--checks all`) on every operation (bodies included, valid
and invalid cases) against the running gateway + store with keys on (its coverage phase,
then drawn cases) and off (drawn cases): no 5xx, no response outside the document, no
request the document allows refused (an unknown model or rollout is a 404 first), none it
forbids served, 405s and OPTIONS naming every method of the path. The document declares
each operation's request body, statuses and bounds; the store's validation errors are 422
wherever it is mounted.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import Response

from tracerl.auth import Keys
from tracerl.server import serving

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_security", ROOT / "bench/security.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


security = _bench()


@pytest.fixture(scope="module", params=["keys on", "keys off"])
def service(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator:  # type: ignore[type-arg]
    keys = security.KEYS if request.param == "keys on" else Keys()
    s = security.start_service(tiny_model_dir, keys)
    yield s
    s.close()


@pytest.mark.fuzz
def test_fuzz_with_every_check_finds_nothing(service) -> None:  # type: ignore[no-untyped-def]
    headers = security.headers_of("admin", security.new_world(service), service.keys)
    # The coverage phase (~3,000 boundary cases) once, with keys on: a minute in all.
    phases = security.PHASES if service.keys.enabled else ("fuzzing",)
    report = security.fuzz(service.url, headers, max_examples=3, budget_s=120, phases=phases)
    assert report.cases > (2_000 if service.keys.enabled else 60)
    assert report.server_errors == 0, report.violations
    assert report.violations == []


@pytest.mark.fuzz
def test_the_fuzz_reports_what_breaks_the_document() -> None:
    app = FastAPI()

    @app.get("/teapot", responses={200: {"description": "fine"}})
    async def teapot(x: int = 0) -> Response:
        return Response(status_code=500 if x % 2 else 418)

    with serving(app) as url:
        report = security.fuzz(url, {}, max_examples=10, budget_s=20)
    assert report.server_errors > 0 and len(report.violations) > report.server_errors


def test_every_operation_declares_its_body_and_statuses(service) -> None:  # type: ignore[no-untyped-def]
    doc = httpx.get(f"{service.url}/openapi.json").json()
    operations = [(p, m, op) for p, item in doc["paths"].items() for m, op in item.items()]
    assert len(operations) >= 24
    for path, method, op in operations:
        codes = set(op["responses"])
        assert {"401", "403", "408", "413"} <= codes, (path, method)
        if method == "post":
            schema = op["requestBody"]["content"]["application/json"]["schema"]
            assert schema.get("type") in ("object", "array"), (path, schema)
        if path.startswith("/store/") and (method == "post" or op.get("parameters")):
            error = op["responses"]["422"]["content"]["application/json"]["schema"]
            assert error["required"] == ["error"], path
    claim = doc["paths"]["/store/claim"]["post"]
    assert set(claim["requestBody"]["content"]["application/json"]["schema"]["properties"]) == {
        "runner_id", "n", "lease_s"
    }  # fmt: skip
    assert "429" in doc["paths"]["/rollouts/{rollout_id}/v1/chat/completions"]["post"]["responses"]


def test_wrong_methods_name_the_allowed_ones(service) -> None:  # type: ignore[no-untyped-def]
    headers = {"x-api-key": security.KEYS.admin}
    for path in ("/v1/chat/completions", "/store/claim"):
        resp = httpx.get(f"{service.url}{path}", headers=headers)
        assert resp.status_code == 405 and resp.headers["allow"] == "POST", path
        assert resp.json()["error"]["message"]
    # A path with a GET route and a POST route: both are named, whichever refused.
    for path in ("/store/tasks", "/store/rollouts"):
        resp = httpx.options(f"{service.url}{path}", headers=headers)
        assert resp.status_code == 405 and resp.headers["allow"] == "GET, HEAD, POST", path


def test_store_bodies_are_held_to_json_types(service) -> None:  # type: ignore[no-untyped-def]
    headers = {"x-api-key": security.KEYS.admin}
    for path, body in [
        ("/store/requeue_expired", {"now": False}),
        ("/store/versions", {"version": 0, "created_at": False}),
        ("/store/claim", {"runner_id": "w1", "n": "1"}),
        ("/store/tasks", [{"id": "big", "input": {"x": 2**70}}]),
        ("/store/tasks", [{"id": "huge", "input": {"x": 1e300}}]),
    ]:
        resp = httpx.post(f"{service.url}{path}", json=body, headers=headers)
        assert resp.status_code == 422, (path, body, resp.text)
    # An integer written as 3.0 is still an integer, as JSON Schema says.
    resp = httpx.post(
        f"{service.url}/store/claim", json={"runner_id": "w1", "n": 1.0}, headers=headers
    )
    assert resp.status_code == 200, resp.text


def test_store_validation_is_422_beside_the_gateway(service) -> None:  # type: ignore[no-untyped-def]
    headers = {"x-api-key": security.KEYS.admin}
    bad = httpx.post(f"{service.url}/store/claim", json={"n": 0}, headers=headers)
    assert bad.status_code == 422 and bad.json()["error"]["type"] == "invalid_request_error"
    query = httpx.get(f"{service.url}/store/rollouts", params={"limit": -1}, headers=headers)
    assert query.status_code == 422


def test_completion_errors_are_invalid_request_errors(service) -> None:  # type: ignore[no-untyped-def]
    headers = {"x-api-key": security.KEYS.admin}
    body = {"model": "policy", "prompt": [10**9]}
    resp = httpx.post(f"{service.url}/v1/completions", json=body, headers=headers)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == "prompt"
