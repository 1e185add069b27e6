"""Driving whole `rft run`s from outside, for `rft chaos` (benchmarks/chaos.py) and the e2e tests (with
tests/support/runs.py): a tiny-model run config, starting `rft` processes from the repository in their own session,
reading a run's files (metrics.jsonl, consumed.jsonl, the latest checkpoint's feed state), finding its parts by
command line (with rft.processes), and reading a topic. Nothing here asserts; tests/support/runs.py waits and checks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from rft.processes import matching
from rft.transport import connect
from rft.transport.config import KafkaConfig

REPO = Path(__file__).resolve().parents[1]  # the checkout: `rft` processes start here
GROUPS_PER_STEP = 4


def write_config(tmp_path: Path, model: Path, name: str, **sections) -> Path:
    """A short tiny-model run on the generated copy_char task (`sections` update the defaults, per section);
    written to `tmp_path/<name>.yaml`, its run directory is `tmp_path/runs/<name>`."""
    config = {
        "run": {"name": name, "max_steps": 6, "output_dir": str(tmp_path / "runs"), "groups_per_step": GROUPS_PER_STEP},
        "model": {"path": str(model), "max_prompt_len": 8, "max_response_len": 1},
        "kafka": {"bootstrap_servers": "embedded", "partitions": 2},
        "explorer": {"replicas": 2, "n_samples": 4, "max_tokens": 1, "tasks_per_batch": 4, "reward": "char_accuracy",
                     "heartbeat_s": 1.0},
        "trainer": {"micro_batch_size": 16, "lr": 3e-3, "checkpoint_every": 2, "poll_timeout_s": 120},
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
