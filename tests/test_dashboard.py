"""The dashboard's JSON API on a synthetic run (bench/dashboard.py's, with real token ids):
filters and pagination against the store's own counts, the trace view, incremental
metrics, run states, control with and without the admin key, and JSON errors for bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import time
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from tracerl.dashboard.app import create_app
from tracerl.dashboard.config import DashboardCommand
from tracerl.pipeline.control_files import ControlState, read_commands
from tracerl.store.sqlite import SqliteStore

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = ("127.0.0.1", 50000)
BASE = "http://127.0.0.1:8765"
"""The page's own address: the dashboard answers to loopback Host names only."""


def bench() -> ModuleType:
    """bench/dashboard.py (a script folder, not a package), imported under a private name."""
    spec = importlib.util.spec_from_file_location(
        "bench_dashboard", ROOT / "bench" / "dashboard.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dash") / "runs"
    bench().synthetic_run(root, "big", 1000, str(tiny_model_dir))
    (root / "notes").mkdir()  # a folder that is not a run
    return root


@pytest.fixture(scope="module")
def client(runs: Path) -> TestClient:
    return TestClient(create_app(runs, admin_key=""), base_url=BASE, client=LOOPBACK)


def get(client: TestClient, path: str, status: int = 200) -> dict:
    r = client.get(path)
    assert r.status_code == status, r.text
    return r.json()


def test_runs_list_and_state(client: TestClient) -> None:
    (run,) = get(client, "/api/runs")["runs"]
    assert run["name"] == "big" and run["steps"] == 7 and run["step"] == 7
    assert run["state"] == "training"  # metrics written just now, no control files


def test_pages_cover_every_rollout_once_newest_first(client: TestClient, runs: Path) -> None:
    seen: list[str] = []
    offset, total = 0, None
    while True:
        page = get(client, f"/api/runs/big/rollouts?limit=300&offset={offset}")
        total = page["total"]
        if not page["rows"]:
            break
        seen += [row["rollout"]["id"] for row in page["rows"]]
        offset += 300
    store = SqliteStore(runs / "big" / "traces.db")
    ids = [r.id for r in store.rollouts()]
    store.close()
    assert total == len(ids) == 1000 and seen == list(reversed(ids))
    last = get(client, "/api/runs/big/rollouts?limit=300&offset=900")
    assert len(last["rows"]) == 100 and last["offset"] == 900


@pytest.mark.parametrize(
    ("query", "check"),
    [
        ("status=failed", lambda row: row["rollout"]["status"] == "failed"),
        ("version=3", lambda row: row["version_min"] <= 3 <= row["version_max"]),
        ("role=checker", lambda row: "checker" in row["roles"]),
        ("reward_min=1", lambda row: row["rollout"]["reward"] >= 1),
        ("reward_max=0&status=succeeded", lambda row: row["rollout"]["reward"] == 0),
        ("q=r0001", lambda row: "r0001" in row["rollout"]["id"]),
        ("step=2", lambda row: row["step"] == 2),
        ("group=big/step4/", lambda row: row["rollout"]["group_id"].startswith("big/step4/")),
        ("task=t3", lambda row: row["rollout"]["task_id"] == "t3"),
    ],
)
def test_each_filter_matches_exactly_what_the_store_holds(
    client: TestClient, runs: Path, query: str, check: object
) -> None:
    page = get(client, f"/api/runs/big/rollouts?{query}&limit=500")
    assert page["rows"] and all(check(row) for row in page["rows"])  # type: ignore[operator]
    # The total is what a scan of the whole store finds.
    everything = get(client, "/api/runs/big/rollouts?limit=500")["rows"]
    everything += get(client, "/api/runs/big/rollouts?limit=500&offset=500")["rows"]
    assert page["total"] == sum(bool(check(row)) for row in everything if _has(row, query))  # type: ignore[operator]


def _has(row: dict, query: str) -> bool:
    """Whether a row can be tested by the filter's check (fields a row may lack)."""
    if "version" in query:
        return row["version_min"] is not None
    if "reward" in query:
        return row["rollout"]["reward"] is not None and (
            "status" not in query or row["rollout"]["status"] == "succeeded"
        )
    if "step" in query:
        return row["step"] is not None
    return True


def test_search_takes_wildcards_literally(client: TestClient) -> None:
    assert get(client, "/api/runs/big/rollouts?q=%25")["total"] == 0
    assert get(client, "/api/runs/big/rollouts?q=_")["total"] == 0


@pytest.mark.parametrize(
    ("path", "status", "says"),
    [
        ("/api/runs/nope/rollouts", 404, "no run"),
        ("/api/runs/notes/rollouts", 404, "no traces.db"),
        ("/api/runs/..%2F..%2Fetc/rollouts", 404, ""),
        ("/api/runs/big/rollouts/nope", 404, "no rollout"),
        ("/api/runs/big/rollouts?limit=0", 400, "limit"),
        ("/api/runs/big/rollouts?limit=abc", 400, "limit"),
        ("/api/runs/big/rollouts?offset=-1", 400, "offset"),
        ("/api/runs/big/rollouts?status=bogus", 400, "status"),
        ("/api/runs/big/rollouts?version=x", 400, "version"),
        ("/api/runs/big/rollouts?colour=red", 400, "colour"),
        ("/api/runs/big/metrics?since=-5", 400, "since"),
    ],
)
def test_bad_input_is_a_json_error_with_a_status(
    client: TestClient, path: str, status: int, says: str
) -> None:
    r = client.get(path)
    assert r.status_code == status
    assert says in r.json()["error"]["message"]


def test_trace_view_nests_sub_agents_and_decodes_tokens(client: TestClient) -> None:
    page = get(client, "/api/runs/big/rollouts?role=checker&status=succeeded&limit=1")
    rid = page["rows"][0]["rollout"]["id"]
    trace = get(client, f"/api/runs/big/rollouts/{rid}")
    assert trace["decoded"] and trace["rollout"]["id"] == rid
    calls = trace["calls"]
    assert [(c["seq"], c["depth"]) for c in calls] == [(0, 0), (2, 1), (1, 0)]  # tree order
    assert calls[1]["parent_span_id"] == calls[0]["id"] and calls[1]["role"] == "checker"
    # A role outside the run's policies decodes with the run's model's tokenizer.
    assert "".join(t["text"] for t in calls[1]["tokens"]) == "looks right"
    text = "".join(t["text"] for t in calls[0]["tokens"])
    assert "calculator" in text and all(t["logprob"] <= 0 for t in calls[0]["tokens"])
    assert calls[2]["messages"][-1]["role"] == "tool"  # only what the call added
    # GRPO over its group: the sign of the advantage follows reward vs the group's mean.
    group = [get(client, f"/api/runs/big/rollouts/{g}")["rollout"] for g in trace["group"]]
    outcomes = [r["reward"] or 0 for r in group if r["status"] in ("succeeded", "failed")]
    mean = sum(outcomes) / len(outcomes)
    adv = calls[0]["tokens"][0]["advantage"]
    if abs(trace["rollout"]["reward"] - mean) > 1e-6:
        assert (adv > 0) == (trace["rollout"]["reward"] > mean)
    assert len(trace["group"]) == 8 and rid in trace["group"]


def test_metrics_are_read_incrementally(client: TestClient, runs: Path) -> None:
    first = get(client, "/api/runs/big/metrics")
    assert [r["step"] for r in first["rows"]] == list(range(1, 8))
    assert get(client, f"/api/runs/big/metrics?since={first['next']}")["rows"] == []
    path = runs / "big" / "metrics.jsonl"
    with path.open("a") as f:
        f.write(json.dumps({"step": 8, "train/reward": 0.5}) + "\n" + '{"step": 9, "trai')
    more = get(client, f"/api/runs/big/metrics?since={first['next']}")
    assert [r["step"] for r in more["rows"]] == [8]  # the torn line waits
    assert get(client, "/api/runs/big/metrics?since=99999999")["reset"] is True
    path.write_text(path.read_text().rsplit("\n", 1)[0] + "\n")  # drop the torn line


def test_health_counts_the_queue_and_leases(client: TestClient, runs: Path) -> None:
    before = time.time()
    health = get(client, "/api/runs/big/health")
    after = time.time()
    store = SqliteStore(runs / "big" / "traces.db")
    assert health["counts"] == store.counts()
    leases = [r.lease_expires_at or 0 for r in store.rollouts(status="running")]  # type: ignore[arg-type]
    store.close()
    assert (
        sum(t < before for t in leases)
        <= health["leases_expired"]
        <= sum(t < after for t in leases)
    )
    assert health["leases_expired"] + health["leases_expiring"] <= len(leases)
    assert health["versions"][0]["role"] == "policy" and health["versions"][0]["version"] == 7
    assert health["versions_published"] == 8


def test_status_says_paused_while_a_loop_is_paused(client: TestClient, runs: Path) -> None:
    state = ControlState(state="paused", step=3, pid=os.getpid(), host=socket.gethostname(),
                         updated_at=time.time(), paused_since=time.time())  # fmt: skip
    (runs / "big" / "control_state.json").write_text(state.model_dump_json())
    try:
        status = get(client, "/api/runs/big/status")
        assert status["state"] == "paused" and status["live"] is True
        dead = state.model_copy(update={"pid": 2**22 + 12345})  # no such process
        (runs / "big" / "control_state.json").write_text(dead.model_dump_json())
        assert get(client, "/api/runs/big/status")["state"] == "stopped"
    finally:
        (runs / "big" / "control_state.json").unlink()


def test_control_is_open_on_loopback_and_sends_to_the_run(client: TestClient, runs: Path) -> None:
    r = client.post("/api/runs/big/control", json={"op": "set", "key": "trainer.lr", "value": 0.01})
    assert r.status_code == 202, r.text
    sent = read_commands(runs / "big")[-1]
    assert (sent.op, sent.key, sent.value, sent.origin) == ("set", "trainer.lr", 0.01, "dashboard")
    pending = get(client, "/api/runs/big/status")["pending"]
    assert pending[-1]["id"] == r.json()["command"]["id"]
    for body, says in [
        ({"op": "explode"}, "op"),
        ({"op": "set", "key": "trainer.epochs", "value": 2}, "cannot be set"),
        ({"op": "set", "key": "trainer.lr", "value": "fast"}, "trainer.lr"),
        ({"op": "pause", "key": "trainer.lr"}, "takes no setting"),
    ]:
        bad = client.post("/api/runs/big/control", json=body)
        assert bad.status_code == 400 and says in bad.json()["error"]["message"]
    other = TestClient(create_app(runs, admin_key=""), base_url=BASE, client=("10.1.2.3", 4000))
    assert other.post("/api/runs/big/control", json={"op": "pause"}).status_code == 403


def test_control_needs_the_admin_key_when_one_is_set(runs: Path) -> None:
    app = TestClient(create_app(runs, admin_key="s3cret"), base_url=BASE, client=LOOPBACK)
    assert app.get("/api/auth").json() == {"required": True}
    before = len(read_commands(runs / "big"))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = app.post("/api/runs/big/control", json={"op": "pause"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "auth"
    assert len(read_commands(runs / "big")) == before
    ok = app.post("/api/runs/big/control", json={"op": "checkpoint"},
                  headers={"Authorization": "Bearer s3cret"})  # fmt: skip
    assert ok.status_code == 202
    assert Counter(c.op for c in read_commands(runs / "big"))["checkpoint"] >= 1


def test_the_dashboard_listens_on_loopback_only() -> None:
    assert DashboardCommand(host="::1").host == "::1"
    for host in ("0.0.0.0", "192.168.1.4", "example.org"):
        with pytest.raises(ValidationError, match="loopback"):
            DashboardCommand(host=host)


def test_the_page_and_its_files_are_served(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "uPlot.iife.min.js" in page.text
    for name in ("app.js", "style.css", "uPlot.iife.min.js", "uPlot.min.css"):
        assert client.get(f"/static/{name}").status_code == 200


# -- assets -------------------------------------------------------------------------------


def _asset_run(root: Path) -> None:
    """runs/assets: a store only (as `tracerl assets` leaves it), with versions, a
    comparison, an optimization, and rollouts that ran with, without and beside the asset."""
    from tracerl.assets.records import Comparison, Optimization, Pair
    from tracerl.types import RolloutStatus, Span, Task

    (root / "assets").mkdir(parents=True)
    s = SqliteStore(root / "assets" / "traces.db")
    s.put_asset("rules", "Answer with twice n.\nBe brief.", note="by hand")
    s.put_asset("rules", "Answer with twice n. ODD TOO.", note="llm:x", candidate=True)
    s.put_asset("rules", "Answer with twice n. ODD TOO.", note="accepted")
    s.put_asset("style", "Be kind.")
    s.add_tasks([Task(id="t", input={"n": 1})])

    def run(group: str, assets: dict[str, int] | None, seen: dict[str, int], reward: float) -> str:
        (r,) = s.enqueue(["t"], group, assets=assets)
        s.claim("r")
        span = Span(id=f"{r.id}-0", rollout_id=r.id, attempt=1, seq=0, role="policy",
                    policy_version=0, prompt_ids=[1], completion_ids=[2], logprobs=[-0.1],
                    assets=seen)  # fmt: skip
        s.add_spans([span])
        s.finish(r.id, 1, RolloutStatus.succeeded, answer="2", reward=reward)
        return r.id

    on = [run("train1/step0/0-t", {"rules": 1}, {"rules": 1}, 1.0) for _ in range(3)]
    off = run("train1/step1/0-t", {"rules": 0}, {}, 0.0)
    arm = run("assets/rules@3/ab", {"rules": 3}, {"rules": 3, "style": 1}, 1.0)
    run("other/x", None, {"style": 1}, 1.0)  # another asset's rollout: not rules'
    pairs = [
        Pair(task_id="t", repeat=0, a=False, b=True, rollout_a=off, rollout_b=arm),
        Pair(task_id="t", repeat=1, a=True, b=False, rollout_a=on[0], rollout_b=off),
        Pair(task_id="t", repeat=2, a=True, b=True, rollout_a=on[1], rollout_b=on[2]),
    ]
    s.add_comparison(Comparison(
        id="c1", name="rules", a=1, b=2, pairs=pairs, success_a=2 / 3, success_b=2 / 3,
        repairs=1, regressions=1, p_value=1.0, purpose="train", optimization="o1",
    ))  # fmt: skip
    s.put_optimization(Optimization(id="o1", name="rules", seed=1, proposer="llm:x",
                                    status="accepted", best=2, accepted=3))  # fmt: skip
    s.close()


def test_asset_pages_show_versions_comparisons_optimizations_and_use(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    _asset_run(root)
    client = TestClient(create_app(root, admin_key=""), base_url=BASE, client=LOOPBACK)
    assert [r["name"] for r in get(client, "/api/runs")["runs"]] == ["assets"]  # a store only
    listed = get(client, "/api/runs/assets/assets")["assets"]
    assert [(a["name"], a["current"], a["versions"], a["candidates"]) for a in listed] == [
        ("rules", 3, 3, 1), ("style", 1, 1, 0),
    ]  # fmt: skip
    assert listed[0]["first_line"] == "Answer with twice n. ODD TOO."
    page = get(client, "/api/runs/assets/assets/rules")
    assert [(v["version"], v["candidate"], v["note"]) for v in page["versions"]] == [
        (1, False, "by hand"), (2, True, "llm:x"), (3, False, "accepted"),
    ]  # fmt: skip
    (row,) = page["comparisons"]
    assert row["pairs"] == 3 and len(row["comparison"]["pairs"]) == 2  # only the ones that moved
    assert (row["comparison"]["repairs"], row["comparison"]["regressions"]) == (1, 1)
    assert [o["status"] for o in page["optimizations"]] == ["accepted"]
    use = {(u["version"], u["source"]): (u["rollouts"], u["success"]) for u in page["use"]}
    assert use == {(0, "train1"): (1, 0.0), (1, "train1"): (3, 1.0), (3, "assets"): (1, 1.0)}


def test_asset_requests_refused_or_empty_as_json(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    _asset_run(root)
    (root / "bare").mkdir()
    (root / "bare" / "config.json").write_text("{}")
    old = root / "old"  # a store written before assets existed
    old.mkdir()
    import sqlite3

    sqlite3.connect(old / "traces.db").execute("CREATE TABLE tasks (id TEXT)").connection.close()
    client = TestClient(create_app(root, admin_key=""), base_url=BASE, client=LOOPBACK)
    for path, status, says in [
        ("/api/runs/assets/assets/nope", 404, "no asset 'nope'"),
        ("/api/runs/assets/assets/bad%20name", 400, "not an asset name"),
        ("/api/runs/bare/assets", 404, "no traces.db"),
        ("/api/runs/missing/assets", 404, "no run"),
        ("/api/runs/old/assets/rules", 404, "no asset"),
    ]:
        r = client.get(path)
        assert r.status_code == status, (path, r.text)
        assert says in r.json()["error"]["message"]
    assert get(client, "/api/runs/old/assets") == {"assets": []}
