"""Keys lock the service: every row of bench/security.py's role x operation table, keys from
the environment and a file, runner ids bound to keys, agent keys that die with their
attempt, `tracerl serve` refusing to listen beyond loopback without keys, and a runner over
HTTP handing its agent the attempt's own key."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from tracerl.agents import AgentResult
from tracerl.auth import Keys, Role
from tracerl.entrypoints import serve
from tracerl.entrypoints.config import ServeCommand
from tracerl.runner import Runner, RunnerConfig
from tracerl.store import StoreError
from tracerl.store.http import StoreClient
from tracerl.types import RolloutStatus, Task

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> ModuleType:
    """bench/security.py (a script folder, not a package), where the table lives."""
    spec = importlib.util.spec_from_file_location("bench_security", ROOT / "bench/security.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


security = _bench()
TABLE = [(op, role) for op in security.EXPECTED for role in security.ROLES]


@pytest.fixture(scope="module")
def service(tiny_model_dir: Path) -> Iterator:  # type: ignore[type-arg]
    s = security.start_service(tiny_model_dir, security.KEYS)
    yield s
    s.close()


@pytest.mark.parametrize(("operation", "role"), TABLE)
def test_role_against_operation(service, operation: str, role: str) -> None:  # type: ignore[no-untyped-def]
    row = security.check(service, operation, role)
    assert row.got == row.expected, row


def test_both_headers_carry_a_key_and_refusals_are_json(service) -> None:  # type: ignore[no-untyped-def]
    admin = security.KEYS.admin
    assert httpx.get(f"{service.url}/store/counts", headers={"x-api-key": admin}).status_code == 200
    bearer = {"authorization": f"Bearer {admin}"}
    assert httpx.get(f"{service.url}/store/counts", headers=bearer).status_code == 200
    resp = httpx.get(f"{service.url}/store/counts", headers={"x-api-key": admin + "x"})
    assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
    assert resp.json()["error"]["type"] == "authentication_error"
    resp = httpx.get(f"{service.url}/store/rollouts", headers={"x-api-key": "runner-key-w1"})
    assert resp.status_code == 403 and resp.json()["error"]["type"] == "permission_error"


def test_a_claim_is_recorded_under_the_runner_id_of_its_key(service) -> None:  # type: ignore[no-untyped-def]
    service.store.enqueue(["t"])
    client = StoreClient(service.url, api_key="runner-key-w2")
    claimed = client.claim("somebody-else", 1, 60.0)
    assert claimed and all(r.runner_id == "w2" for r in claimed)
    rollout = claimed[0]
    key = client.agent_key(rollout.id, rollout.attempt)
    assert key is not None and key.startswith("ak.")
    # The minted key opens this attempt's model calls, and the runner finishes its own.
    call = httpx.post(
        f"{service.url}/rollouts/{rollout.id}/v1/chat/completions",
        json={"model": "policy", "messages": security.MESSAGES},
        headers={"authorization": f"Bearer {key}"},
    )
    assert call.status_code == 200, call.text
    assert client.finish(rollout.id, rollout.attempt, RolloutStatus.succeeded).status == "succeeded"
    client.close()


def test_agent_keys_are_bound_to_one_attempt(service) -> None:  # type: ignore[no-untyped-def]
    world = security.new_world(service)
    keys = service.keys
    assert keys.identify(world.agent_key).role is Role.agent
    tampered = world.agent_key[:-1] + ("0" if world.agent_key[-1] != "0" else "1")
    assert keys.identify(tampered) is None
    assert keys.identify(keys.agent_key(world.a, 2)).attempt == 2  # valid form, other attempt
    body = {"model": "policy", "messages": security.MESSAGES}
    url = f"{service.url}/rollouts/{world.a}/v1/chat/completions"
    later = {"authorization": f"Bearer {keys.agent_key(world.a, 2)}"}
    assert httpx.post(url, json=body, headers=later).status_code == 401
    # The lease runs out and the rollout is re-queued: the first attempt's key is dead.
    service.store.requeue_expired(now=10**12)
    now = {"authorization": f"Bearer {world.agent_key}"}
    assert httpx.post(url, json=body, headers=now).status_code == 401


def test_store_client_without_its_key_is_refused(service) -> None:  # type: ignore[no-untyped-def]
    client = StoreClient(service.url, api_key="")
    with pytest.raises(StoreError, match="HTTP 401"):
        client.counts()
    client.close()


def test_keys_come_from_the_environment_and_a_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text('admin = "from-file"\n[runners]\nw1 = "k1"\n')
    keys = Keys.load(path, env={"TRACERL_RUNNER_KEYS": "w2=k2, bare-key"})
    assert keys.admin == "from-file" and keys.runners["w1"] == "k1" and keys.runners["w2"] == "k2"
    assert keys.identify("bare-key").role is Role.runner
    assert Keys.load(path, env={"TRACERL_ADMIN_KEY": "env"}).admin == "env"
    # The agent-key secret follows the admin key: two gateways sharing it agree.
    assert (
        Keys.load(env={"TRACERL_ADMIN_KEY": "a"}).secret
        == Keys.load(env={"TRACERL_ADMIN_KEY": "a"}).secret
    )
    assert not Keys.load(env={}).enabled
    path.write_text("admin = 3\n")
    with pytest.raises(ValueError, match="admin must be a string"):
        Keys.load(path, env={})


def test_serve_refuses_to_listen_beyond_loopback_without_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRACERL_ADMIN_KEY", raising=False)
    monkeypatch.delenv("TRACERL_RUNNER_KEYS", raising=False)
    with pytest.raises(SystemExit, match="refusing to serve on 0.0.0.0 without keys"):
        serve._keys(ServeCommand(model="m", host="0.0.0.0"))
    assert not serve._keys(ServeCommand(model="m", host="127.0.0.1")).enabled
    assert not serve._keys(ServeCommand(model="m", host="::1")).enabled
    monkeypatch.setenv("TRACERL_ADMIN_KEY", "secret-admin")
    keys = serve._keys(ServeCommand(model="m", host="0.0.0.0"))
    assert keys.enabled and "secret-admin" not in serve._keys_line(keys)


def test_no_keys_leaves_every_route_open(tiny_model_dir: Path) -> None:
    s = security.start_service(tiny_model_dir, Keys())
    try:
        assert httpx.get(f"{s.url}/store/rollouts").status_code == 200
        world = security.new_world(s)
        resp = httpx.post(f"{s.url}/rollouts/{world.b}/reward", json={"value": 1})
        assert resp.status_code == 200
    finally:
        s.close()


@pytest.mark.slow
def test_a_runner_hands_its_agent_the_attempt_key(service) -> None:  # type: ignore[no-untyped-def]
    service.store.add_tasks([Task(id="solo", input={"q": 1})])
    (queued,) = service.store.enqueue(["solo"], group_id="solo-group")
    seen: list[str] = []

    async def agent(task: Task, base_url: str, api_key: str, model: str) -> AgentResult:
        seen.append(api_key)
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {api_key}"}) as http:
            body = {"model": model, "messages": security.MESSAGES}
            resp = await http.post(f"{base_url}/chat/completions", json=body)
            resp.raise_for_status()
        return AgentResult(resp.json()["choices"][0]["message"]["content"], reward=1.0)

    async def run_until_done() -> None:
        # Other tests' rollouts stay running: stop once ours is finished, not when idle.
        stop = asyncio.Event()
        cfg = RunnerConfig(concurrency=4)
        runner = Runner(client, service.url, agent, None, cfg, "w1", on_finish=lambda r: stop.set())
        await asyncio.wait_for(runner.run(until_idle=False, stop=stop), 60)

    client = StoreClient(service.url, api_key="runner-key-w1")
    while service.store.get_rollout(queued.id).status is RolloutStatus.queued:
        asyncio.run(run_until_done())
    client.close()
    done = service.store.get_rollout(queued.id)
    assert done.status == RolloutStatus.succeeded, done.error
    assert seen and all(k.startswith("ak.") for k in seen)
    assert len(service.store.spans(queued.id)) == 1
