"""A local `rft run` on the durable embedded broker (`kafka.embedded_data_dir`) killed outright, then run again:

everything is SIGKILLed mid-run at once (the `rft run` process group and every part it started; its broker's two
processes die with it), and the same `rft run` command started again comes back on the same broker data (the tasks
are not published again), resumes from the trainer's checkpoint and finishes with no experience group lost or
trained twice (by group id, from consumed.jsonl against the experiences topic, read from the broker data after
the run ended). The run is async without flow control (`run.async_max_staleness: null`): the explorers never wait for
the trainer, and staleness is recorded every step (async's flow control: tests/integration/test_admission.py).

Before the kill, the run is the suite's check of where a whole run listens: with the dashboard, Prometheus endpoints,
the durable broker and its object server, no part of its process tree holds a socket in LISTEN state on every
interface (0.0.0.0 or ::): each binds where it is told, 127.0.0.1 by default (read from /proc: tests/listeners.py;
the push group's store: tests/e2e/test_run_faults.py).
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import yaml

from benchmarks.runs import no_process_left, read_topic, rft_run, steps_done, write_config
from rft.broker.local import LocalBroker, tansu_binary
from rft.processes import free_port, kill_matching
from rft.schema import ControlMessage, decode
from tests.listeners import assert_no_wildcard_listener
from tests.support.runs import assert_trained_exactly_once, finish, wait_for_step

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.distributed, pytest.mark.integration]


def test_a_local_run_killed_outright_resumes_on_its_durable_broker_exactly_once(tmp_path, tiny_model):
    steps, name = 8, "durable-run"
    prometheus, dashboard = free_port(), free_port()
    config = write_config(tmp_path, tiny_model, name, run={"mode": "async", "max_steps": steps,
                                                             "async_max_staleness": None},
                          kafka={"bootstrap_servers": "embedded", "embedded_data_dir": "broker"},
                          explorer={"replicas": 1},
                          monitor={"prometheus_port": prometheus, "dashboard_port": dashboard})
    run_dir, log = tmp_path / "runs" / name, tmp_path / "run.log"
    data = run_dir / "broker"

    first = rft_run(config, log)
    wait_for_step(first, run_dir, 3, log)
    port = json.loads((data / "broker.json").read_text())["port"]
    try:  # broker, object server, dashboard and the parts' Prometheus endpoints
        assert_no_wildcard_listener(first, log, ports={dashboard, port}, prometheus=prometheus, parts=4)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the run and, at once, every part it started (each in its own session)
        kill_matching(str(run_dir / "config.yaml"))
    first.wait()
    assert no_process_left(str(run_dir / "config.yaml")), "a part outlived the kill"
    assert no_process_left(str(data)), "the broker's S3 server outlived its run"
    assert no_process_left(str(tansu_binary()), f"tcp://127.0.0.1:{port}"), "the broker outlived its run"
    interrupted_at = max(m["step"] for m in steps_done(run_dir))
    assert interrupted_at < steps

    second = rft_run(config, log)
    assert finish(second, log) == 0, log.read_text()[-4000:]
    text = log.read_text()
    resumed_log = text.split("embedded broker: durable", 2)[2]
    # the resumed run found all its tasks (8000: write_config's 400 x 20 epochs) and published none again (it once
    # counted 7985 under load, misreading the topic's end: rft/transport/kafka.py `end_offsets`)
    assert "already holds 8000 tasks: not publishing again" in resumed_log, resumed_log
    assert "published 8000 tasks" not in resumed_log

    resumed = yaml.safe_load((run_dir / "config.yaml").read_text())["kafka"]["bootstrap_servers"]
    assert resumed == f"127.0.0.1:{port}"  # the same address: the port was free again

    with LocalBroker(data_dir=data) as broker:  # the run's broker data, after both runs
        assert_trained_exactly_once(run_dir, broker.bootstrap_servers, f"{name}.experiences", steps)
        control = [decode(m.value, m.headers) for m in read_topic(broker.bootstrap_servers, f"{name}.control")]

    # async mode: the explorers never waited for the trainer (the heartbeats of both runs, and the final stats of
    # the second: the first was killed outright), and staleness is recorded every step
    beats = [c.body for c in control if isinstance(c, ControlMessage) and c.kind == "explorer_heartbeat"]
    assert beats and max(b["groups"] for b in beats) > 0, beats
    assert all(b["admission_waits"] == 0 for b in beats), beats
    assert all(s["admission_waits"] == 0 for s in final_stats(run_dir / "logs" / "explorer-0.log"))
    assert all("staleness_hist" in m for m in steps_done(run_dir))


def final_stats(log: Path) -> list[dict]:
    """The explorer's "final stats" lines (one per run that ended it cleanly)."""
    stats = [json.loads(line.split("final stats: ", 1)[1]) for line in log.read_text().splitlines()
             if "final stats: " in line]
    assert stats, f"no final stats in {log}"
    return stats
