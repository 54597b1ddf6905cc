"""The dashboard in a real browser (the system chromium, driven by Playwright) over a real
training run: the reward curve fills in, a rollout's tokens show coloured by log-prob, and
the Pause button pauses the run (the training loop blocks; the status endpoint says so)
until Stop ends it cleanly. Screenshots are kept as artifacts ($TRACERL_ARTIFACTS, else the
test's tmp dir; the path is printed)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from tests import needs
from tracerl.dashboard.app import create_app
from tracerl.server import serving

from .test_control import background_run, run_config

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
"""Debian's chromium (`apt-get install chromium`); Playwright never downloads a browser."""


def _browser_or_skip() -> None:
    """Skip without chromium or Playwright; in CI (CI=true) their absence is a failure."""
    absent = [
        what
        for what, ok in (("chromium", Path(CHROMIUM).exists()), ("playwright", _has_playwright()))
        if not ok
    ]
    if absent:
        needs.missing(
            "browser",
            f"needs {' and '.join(absent)} (apt-get install chromium; pip install '.[dev]')",
        )


def _has_playwright() -> bool:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return True


def test_the_page_follows_a_live_run_and_pauses_it(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _browser_or_skip()
    from playwright.sync_api import expect, sync_playwright

    artifacts = Path(os.environ.get("TRACERL_ARTIFACTS", tmp_path / "artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("SLOW_AGENT_SLEEP", "0.1")
    cfg = run_config(tmp_path, tiny_model_dir, steps=40)
    app = create_app(tmp_path / "runs", admin_key="")
    with background_run(cfg) as run, serving(app) as url, sync_playwright() as p:
        run.wait(lambda: len(run.steps()) >= 2)
        browser = p.chromium.launch(executable_path=CHROMIUM)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.on("dialog", lambda dialog: dialog.accept())  # Stop asks for confirmation
        page.goto(f"{url}/?run={cfg.name}")

        # The reward curve: a uPlot canvas with this run's points, growing live.
        chart = page.locator("#chart-train-reward")
        expect(chart.locator("canvas").first).to_be_visible(timeout=20_000)
        page.wait_for_function(
            "() => +document.querySelector('#chart-train-reward').dataset.points >= 2"
        )
        seen = int(chart.get_attribute("data-points") or 0)
        page.wait_for_function(
            f"() => +document.querySelector('#chart-train-reward').dataset.points > {seen}",
            timeout=60_000,
        )

        # A finished rollout's trace: its calls and tokens coloured by log-prob.
        page.select_option("#filters select[name=status]", "succeeded")
        page.click("#filters button[type=submit]")
        page.locator("#rollouts tbody tr").first.click()
        tokens = page.locator("#trace-a .tok")
        expect(tokens.first).to_be_visible(timeout=20_000)
        assert tokens.count() > 0 and "logprob" in (tokens.first.get_attribute("title") or "")
        assert "hsl(" in (tokens.first.get_attribute("style") or "")
        assert page.locator("#trace-a .call").count() == 2  # the agent's two calls
        page.select_option("#colour", "advantage")
        assert "hsl(" not in (tokens.first.get_attribute("style") or "")
        page.screenshot(path=artifacts / "dashboard-trace.png", full_page=True)

        # Another run on the same charts: its own dashed series, named in the legend.
        other = tmp_path / "runs" / "other"
        other.mkdir()
        (other / "config.json").write_text(
            cfg.model_copy(update={"name": "other"}).model_dump_json()
        )
        lines = [{"step": s, "train/reward": 0.5} for s in (1, 2, 3)]
        (other / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        page.wait_for_function(
            "() => [...document.querySelectorAll('#compare option')].some(o => o.value === 'other')"
        )
        before = int(chart.get_attribute("data-points") or 0)
        page.select_option("#compare", "other")
        page.wait_for_function(
            f"() => +document.querySelector('#chart-train-reward').dataset.points >= {before + 3}"
        )
        assert "other" in chart.locator(".u-legend").inner_text()

        # Pause: the page, the status endpoint and the loop agree; no step while paused.
        page.click("#btn-pause")
        expect(page.locator("#run-state")).to_have_text("paused", timeout=60_000)
        status = httpx.get(f"{url}/api/runs/{cfg.name}/status").json()
        assert status["state"] == "paused" and status["control"]["state"] == "paused"
        at_pause = run.steps()
        time.sleep(2.5)
        assert run.steps() == at_pause
        page.screenshot(path=artifacts / "dashboard-paused.png", full_page=True)

        page.click("#btn-stop")
        summary = run.join()
        expect(page.locator("#run-state")).to_have_text("finished", timeout=30_000)
        browser.close()
    assert summary.steps == len(at_pause) < 40
    print(f"\nscreenshots: {artifacts}")


def test_the_asset_panel_shows_versions_comparisons_and_links_to_traces(tmp_path: Path) -> None:
    _browser_or_skip()
    from playwright.sync_api import expect, sync_playwright

    from .test_dashboard import _asset_run

    root = tmp_path / "runs"
    _asset_run(root)
    with serving(create_app(root, admin_key="")) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.goto(f"{url}/?run=assets")
        page.locator("#assets tbody tr", has_text="rules").click()
        body = page.locator("#asset-body")
        expect(body).to_contain_text("candidate", timeout=20_000)
        expect(body).to_contain_text("v1 vs v2")
        expect(body).to_contain_text("withheld")
        page.locator("#asset-body tr", has_text="v1 vs v2").click()
        expect(body).to_contain_text("regression")
        body.locator("a.trace-link").first.click()
        expect(page.locator("#trace-panel")).to_be_visible()
        expect(page.locator("#trace-a")).to_contain_text("reward")
        browser.close()
