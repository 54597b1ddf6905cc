"""What a web page may not do to a tracerl server, and what an anonymous client may not
make it read: a cross-origin or text/plain request is refused, a rebound Host name is
refused while no keys are set, and with keys a caller without one is refused from the
headers alone, before its body is read. Real clients (SDKs, runners, the dashboard's own
page) are served as before."""

from __future__ import annotations

import importlib.util
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from urllib.parse import urlparse

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient

from tracerl.auth import Keys
from tracerl.dashboard.app import create_app as create_dashboard
from tracerl.pipeline.control_files import read_commands
from tracerl.server import serving

ROOT = Path(__file__).resolve().parents[1]
EVIL = "http://evil.example"
VERSION = {"version": 8, "path": "/any/path", "role": "policy"}


def _bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / f"bench/{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


security = _bench("security")


@pytest.fixture(scope="module")
def keyless(tiny_model_dir: Path) -> Iterator:  # type: ignore[type-arg]
    s = security.start_service(tiny_model_dir, Keys())
    yield s
    s.close()


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path) -> Iterator:  # type: ignore[type-arg]
    s = security.start_service(tiny_model_dir, security.KEYS)
    yield s
    s.close()


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error: dict = resp.json()["error"]
    assert error["message"] and error["type"]
    return error


def test_a_web_page_cannot_publish_a_version(keyless) -> None:  # type: ignore[no-untyped-def]
    url, body = f"{keyless.url}/store/versions", orjson.dumps(VERSION)
    # A "simple" cross-origin request (no CORS preflight): text/plain, the page's Origin.
    page = {"content-type": "text/plain", "origin": EVIL}
    _error(httpx.post(url, content=body, headers=page), 403)
    # JSON from another origin, and text/plain from no origin at all, are refused too.
    _error(httpx.post(url, content=body, headers={**page, "content-type": "application/json"}), 403)
    _error(httpx.post(url, content=body, headers={"content-type": "text/plain"}), 415)
    assert keyless.store.latest_version("policy") is None
    chat = orjson.dumps({"model": "policy", "messages": security.MESSAGES})
    chat_url = f"{keyless.url}/v1/chat/completions"
    _error(httpx.post(chat_url, content=chat, headers={"content-type": "text/plain"}), 415)
    _error(httpx.post(f"{keyless.url}/v1/models", headers={"origin": EVIL}), 403)
    # The server's own origin (a page it serves), and clients that send no Origin, are served.
    own = {"content-type": "application/json; charset=utf-8", "origin": keyless.url}
    assert httpx.post(url, content=body, headers=own).status_code == 204
    assert httpx.post(chat_url, json={"model": "policy", "messages": security.MESSAGES}).is_success


def test_a_rebound_host_name_is_refused_without_keys(keyless) -> None:  # type: ignore[no-untyped-def]
    port = urlparse(keyless.url).port
    rebound = httpx.get(f"{keyless.url}/store/rollouts", headers={"host": f"evil.example:{port}"})
    assert _error(rebound, 400)["code"] == "host_not_allowed"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "127.0.0.1", f"[::1]:{port}"):
        assert httpx.get(f"{keyless.url}/store/rollouts", headers={"host": host}).status_code == 200


def test_with_keys_any_host_is_served_but_not_a_foreign_origin(keyed) -> None:  # type: ignore[no-untyped-def]
    admin = {"authorization": f"Bearer {security.KEYS.admin}"}
    port = urlparse(keyed.url).port
    named = {**admin, "host": f"gateway.cluster.internal:{port}"}
    assert httpx.get(f"{keyed.url}/store/rollouts", headers=named).status_code == 200
    foreign = httpx.post(
        f"{keyed.url}/store/versions", json=VERSION, headers={**admin, "origin": EVIL}
    )
    _error(foreign, 403)
    plain = {**admin, "content-type": "text/plain"}
    _error(
        httpx.post(f"{keyed.url}/store/versions", content=orjson.dumps(VERSION), headers=plain), 415
    )


def _answer_before_the_body(url: str, path: str, headers: dict[str, str]) -> bytes:
    """Announce a 60 MB body, send 1 KB of it, and read what the server says meanwhile."""
    parsed = urlparse(url)
    lines = [f"POST {path} HTTP/1.1", f"Host: {parsed.netloc}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines += [f"Content-Length: {60 * 2**20}", "", ""]
    with socket.create_connection((parsed.hostname, parsed.port), timeout=5) as conn:
        conn.sendall("\r\n".join(lines).encode() + b"[" + b" " * 1023)
        return conn.recv(4096)


@pytest.mark.parametrize(
    ("path", "headers", "status"),
    [
        ("/store/versions", {}, b"401"),
        ("/store/spans", {"authorization": "Bearer forged"}, b"401"),
        ("/v1/chat/completions", {}, b"401"),
        ("/store/versions", {"authorization": "Bearer runner-key-w1"}, b"403"),
    ],
)
def test_a_caller_without_the_right_key_is_refused_before_its_body(
    keyed, path: str, headers: dict[str, str], status: bytes
) -> None:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    answer = _answer_before_the_body(keyed.url, path, headers)
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
    assert time.monotonic() - started < 3


# -- the dashboard ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("doors") / "runs"
    _bench("dashboard").synthetic_run(root, "r", 10, str(tiny_model_dir))
    return root


def test_a_web_page_cannot_steer_the_dashboard(runs: Path) -> None:
    client = TestClient(
        create_dashboard(runs, admin_key=""),
        base_url="http://127.0.0.1:8765",
        client=("127.0.0.1", 5000),
    )
    url, pause = "/api/runs/r/control", orjson.dumps({"op": "pause"})
    before = len(read_commands(runs / "r"))
    page = {"content-type": "text/plain", "origin": EVIL}
    assert client.post(url, content=pause, headers=page).status_code == 403
    assert (
        client.post(url, content=pause, headers={"content-type": "text/plain"}).status_code == 415
    )
    rebound = client.get("/api/runs", headers={"host": "evil.example:8765"})
    assert rebound.status_code == 400 and rebound.json()["error"]["message"]
    assert len(read_commands(runs / "r")) == before
    # The dashboard's own page (same origin, JSON) steers it as before.
    own = {"content-type": "application/json", "origin": "http://127.0.0.1:8765"}
    assert client.post(url, content=pause, headers=own).status_code == 202
    assert client.get("/api/runs", headers={"origin": "http://127.0.0.1:8765"}).status_code == 200


def test_a_web_page_cannot_pause_an_engine_server() -> None:
    """The transformers engine server listens on loopback without keys too."""
    from tracerl.engines.hf_server import create_app as engine_app

    class Idle:
        policy_version = 0

    with serving(engine_app(Idle())) as url:  # type: ignore[arg-type]
        assert httpx.post(f"{url}/pause", headers={"origin": EVIL}).status_code == 403
        rebound = httpx.get(f"{url}/health", headers={"host": "evil.example"})
        assert rebound.status_code == 400
        assert httpx.post(f"{url}/pause").status_code == 200  # RemoteEngine's own calls
        assert httpx.post(f"{url}/resume").status_code == 200
