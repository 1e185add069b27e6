"""Helpers to drive whole `rft run`s from outside, shared by the e2e fault tests (tests/e2e/test_run_faults.py,
tests/e2e/test_chaos.py) and `rft chaos` (rft/bench/chaos.py): a tiny-model run config, starting `rft` processes in
their own session, reading a run's files (metrics.jsonl, consumed.jsonl, the latest checkpoint's feed state),
finding its parts by command line (with rft.processes), and reading a topic.

Failures (a run that ends early, a step that does not come, a run that does not finish) raise `RunFailed` (an
AssertionError, so a test shows its message as a failed assertion) with the tail of the run's log.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from rft.processes import matching, signal_group
from rft.transport import connect
from rft.transport.config import KafkaConfig

REPO = Path(__file__).resolve().parents[2]
GROUPS_PER_STEP = 4


class RunFailed(AssertionError):
    pass


def write_config(tmp_path: Path, model: Path, name: str, **sections) -> Path:
    """A short tiny-model run on the generated copy_char task (`sections` update the defaults, per section);
    written to `tmp_path/<name>.yaml`, its run directory is `tmp_path/runs/<name>`."""
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


def start(command: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """`command` in the repository, in a session of its own (so its whole tree can be signalled), output to `log`."""
    return subprocess.Popen(command, cwd=REPO, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))


def rft_run(config: Path, log: Path) -> subprocess.Popen:
    return start([sys.executable, "-m", "rft.cli", "run", str(config)], log)


def rft_explorer(config: Path, explorer_id: str, log: Path, *overrides: str) -> subprocess.Popen:
    """An `rft explorer` joining the run of `config` (`overrides`: `--set` values, e.g. another bootstrap)."""
    sets = [arg for value in overrides for arg in ("--set", value)]
    return start([sys.executable, "-m", "rft.cli", "explorer", str(config), "--explorer-id", explorer_id, *sets], log)


def log_tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else f"({log} does not exist)"


def steps_done(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def last_step(run_dir: Path) -> int:
    return max((m["step"] for m in steps_done(run_dir)), default=0)


def wait_for_step(process: subprocess.Popen, run_dir: Path, step: int, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while last_step(run_dir) < step:
        if process.poll() is not None:
            raise RunFailed(f"run ended early ({process.returncode}):\n{log_tail(log)}")
        if time.monotonic() > deadline:
            raise RunFailed(f"no step {step} after {timeout_s} s:\n{log_tail(log)}")
        time.sleep(0.5)


def finish(process: subprocess.Popen, log: Path, timeout_s: float = 400) -> int:
    """The exit status of `process`; after `timeout_s`, its whole session is SIGKILLed and RunFailed raised."""
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        signal_group(process, signal.SIGKILL)  # the run and every part it started
        raise RunFailed(f"run did not finish in {timeout_s} s:\n{log_tail(log)}") from None


def no_process_left(*needles: str, timeout_s: float = 10) -> bool:
    """True once no process matches (children a killed trainer forked, e.g. megatron's checkpoint writers, die
    with it: rft/trainer/main.py asks Linux for that)."""
    deadline = time.monotonic() + timeout_s
    while matching(*needles):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def read_topic(bootstrap: str, topic: str, end: dict[str, int] | None = None) -> list:
    """Every record of `topic` (up to the offsets `end`, "topic:partition" -> next offset)."""
    source = connect(KafkaConfig(), bootstrap).source()
    try:
        return list(source.read_range(topic, end=end))
    finally:
        source.close()


def consumed(run_dir: Path) -> list[dict]:
    """The trainer's consumed.jsonl: one record per group trained ({step, group_id, policy_version, staleness})."""
    path = run_dir / "consumed.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def latest_checkpoint_state(run_dir: Path) -> dict | None:
    """trainer_state.json of the newest complete checkpoint (None: none yet)."""
    checkpoints = run_dir / "checkpoints"
    if not (checkpoints / "latest").exists():
        return None
    return json.loads((checkpoints / (checkpoints / "latest").read_text().strip() / "trainer_state.json").read_text())


def assert_trained_exactly_once(run_dir: Path, bootstrap: str, topic: str, steps: int) -> list[str]:
    """Every step 1..`steps` full (GROUPS_PER_STEP groups), no group trained twice (by group id), and every group
    the trainer's last checkpointed offsets cover on `topic` was trained (nothing lost; async mode drops none as
    stale). Returns the trained group ids."""
    from rft.schema import decode_group  # heavy: numpy

    records = consumed(run_dir)
    assert sorted({r["step"] for r in records}) == list(range(1, steps + 1))
    assert len(records) == steps * GROUPS_PER_STEP
    trained = [r["group_id"] for r in records]
    assert len(set(trained)) == len(trained), "a group was trained twice"
    state = latest_checkpoint_state(run_dir)
    assert state is not None, f"no checkpoint in {run_dir}"
    covered = {decode_group(m.value, m.headers).group_id
               for m in read_topic(bootstrap, topic, end=state["feed"]["offsets"])}
    assert covered == set(trained), f"lost: {sorted(covered - set(trained))[:5]}"
    return trained
