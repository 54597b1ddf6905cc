"""bench/chaos.py, small: `tracerl train`, `tracerl runner` and `tracerl serve` each killed
with SIGKILL at random points; every job resumes and finishes, no committed rollout is
lost, none is trained (or re-run after its commit) twice, and the stores pass
integrity_check. An engine server of a run with two replicas, killed the same way, is
restarted by the run itself, which finishes without a call failing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _chaos():
    spec = importlib.util.spec_from_file_location("bench_chaos", ROOT / "bench" / "chaos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_three_kills_of_each_kind_lose_nothing(tmp_path: Path) -> None:
    result = _chaos().run(kills=3, seed=1, kinds=["train", "runner", "serve"], tmp=tmp_path)
    for kind, r in result["kinds"].items():
        assert r["kills"] >= 1, f"{kind}: the job ended before it could be killed"
        assert r["resumed_ok"] == r["kills"], f"{kind}: a job did not resume and finish"
        assert r["lost"] == 0, f"{kind}: committed rollouts lost"
        assert r["twice"] == 0, f"{kind}: rollouts trained or re-run twice"
        assert r["integrity_ok"], f"{kind}: integrity_check failed"


def test_engine_servers_killed_under_a_run_are_restarted_by_it(tmp_path: Path) -> None:
    r = _chaos().run(kills=2, seed=1, kinds=["engine"], tmp=tmp_path)["kinds"]["engine"]
    assert r["kills"] >= 1, "the run ended before an engine server could be killed"
    assert r["resumed_ok"] == r["kills"], "the run did not finish"
    assert r["engine_restarts"] >= 1, "no killed replica was brought back"
    assert r["lost"] == 0 and r["twice"] == 0 and r["integrity_ok"]
    assert r["error_failed"] == 0, "a call failed although another replica was up"
