"""The live run page in a real headless browser (Debian's chromium, driven by selenium through Debian's
chromedriver): a real short `rft run` of the tiny model (two explorers, the Megatron trainer under torchrun, the
embedded broker) with `monitor.dashboard_port` set, so `rft run` starts `rft dashboard` as one of its parts.

The test waits on the page itself (tests/waiting.py) until the reward curve has points and the fleet table shows
both explorers holding trained weights, SIGKILLs one explorer, waits until the page shows it silent, takes a
screenshot, and checks from the DOM that the curve's points are the run's own (metrics.jsonl), so are the
training-inference mismatch chart's (overall and by staleness), and the config shown is the run's.
"""
from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest

from rft.bench.run_support import finish, rft_run, steps_done, write_config
from rft.processes import free_port, kill_matching
from tests.waiting import tail_of, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.integration]

CHROMEDRIVER = "/usr/bin/chromedriver"
MIN_POINTS = 4


@pytest.fixture
def browser():
    if not shutil.which("chromium") or not Path(CHROMEDRIVER).exists():
        pytest.fail("chromium and chromedriver are missing: `make system-deps` installs them (Debian packages "
                    "chromium, chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,2400"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)  # explicit: selenium-manager never runs
    yield driver
    driver.quit()


FLEET_JS = """return Array.from(document.querySelectorAll('tr[data-explorer]')).map(
    r => ({id: r.dataset.explorer, state: r.dataset.state, version: Number(r.dataset.version)}))"""
POINTS_JS = """return Array.from(document.querySelectorAll(
    'figure[data-chart="reward"] circle[data-series="reward_mean"]')).map(c => [Number(c.dataset.step), Number(c.dataset.y)])"""
SERIES_JS = """return Array.from(document.querySelectorAll('figure[data-chart="mismatch"] circle')).map(
    c => [c.dataset.series, Number(c.dataset.step), Number(c.dataset.y)])"""


def test_the_run_page_follows_a_live_run_and_shows_a_killed_explorer_silent(tmp_path, tiny_model, browser):
    port = free_port()
    config = write_config(tmp_path, tiny_model, "dash-run", run={"mode": "off_policy", "max_staleness": 1,
                                                                  "max_steps": 400},
                          explorer={"engine": "transformers"}, monitor={"dashboard_port": port})
    run_dir, log = tmp_path / "runs" / "dash-run", tmp_path / "run.log"
    process = rft_run(config, log)
    try:
        def page_loaded():
            try:
                browser.get(f"http://127.0.0.1:{port}/")
            except Exception:  # the dashboard part is not listening yet
                return False
            return browser.execute_script("return document.querySelector('figure[data-chart=\"reward\"]') !== null")

        watch = {"alive": [process], "context": tail_of(log), "interval": 0.5}  # the run must not end meanwhile
        wait_until(page_loaded, what="the page", timeout=120, **watch)
        wait_until(lambda: len(browser.execute_script(POINTS_JS)) >= MIN_POINTS, timeout=240,
                   what=f"{MIN_POINTS} reward points on the page", **watch)

        def fleet() -> dict[str, dict]:
            return {e["id"]: e for e in browser.execute_script(FLEET_JS)}

        def both_trained() -> list[dict]:
            trained = [e for e in fleet().values() if e["state"] == "live" and e["version"] >= 1]
            return trained if len(trained) == 2 else []

        trained = wait_until(both_trained, what="both explorers live with trained weights", timeout=120, **watch)
        assert {e["id"] for e in trained} == {"explorer-0", "explorer-1"}

        assert kill_matching("rft.cli explorer", str(run_dir / "config.yaml"), "explorer-1"), "explorer-1 not found"
        killed_at = time.monotonic()
        states = wait_until(lambda: fleet().get("explorer-1", {}).get("state") == "silent" and fleet(),
                            what="explorer-1 silent on the page", timeout=30, **watch)
        silent_after_s = time.monotonic() - killed_at
        assert states["explorer-0"]["state"] == "live"
        # the page keeps following the run after the kill: more points arrive
        before = len(browser.execute_script(POINTS_JS))
        wait_until(lambda: len(browser.execute_script(POINTS_JS)) > before, what="a point after the kill",
                   timeout=120, **watch)
        shot = tmp_path / "dashboard.png"
        browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000

        # the DOM against the run's own files: every point drawn is the step's reward in metrics.jsonl
        points = browser.execute_script(POINTS_JS)
        rewards = {m["step"]: m["reward_mean"] for m in steps_done(run_dir) if "reward_mean" in m}
        assert len(points) >= MIN_POINTS + 1
        for step, y in points:
            assert rewards[step] == pytest.approx(y), f"step {step}: page {y}, metrics.jsonl {rewards[step]}"
        assert [s for s, _ in points] == sorted(rewards)[:len(points)]
        # the training-inference mismatch chart: overall and by staleness, the steps' own values
        records = {m["step"]: m for m in steps_done(run_dir)}
        drawn = browser.execute_script(SERIES_JS)
        assert {"logprob_mismatch_mean", "logprob_mismatch_stale0_mean"} <= {name for name, _, _ in drawn}
        for name, step, y in drawn:
            assert records[step][name] == pytest.approx(y, rel=1e-3), f"{name} at step {step}"
        summary = browser.find_element("css selector", '[data-summary="dash-run"]')
        assert summary.get_attribute("data-run-state") == "running"
        assert "max staleness 1" in summary.text and "off_policy" in summary.text
        shown = browser.execute_script("return document.querySelector('[data-config=\"dash-run\"]').textContent")
        assert "name: dash-run" in shown and "engine: transformers" in shown
        assert browser.execute_script(
            "return document.querySelectorAll('line[data-event=\"join\"]').length") >= 2  # joins on the time axis
        print(json.dumps({"explorer_silent_on_page_after_s": round(silent_after_s, 1), "points": len(points)}))
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        assert finish(process, log) in (0, 130)
