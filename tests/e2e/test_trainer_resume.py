"""The trainer under torchrun, fed from a real broker: an uninterrupted run, then a run SIGKILLed at a random
point and restarted. The (group id, step) sequence the restarted run trains on equals the uninterrupted one:
no group missing, none twice, even though the kill can fall between a step and its checkpoint. The run trains LoRA
adapters (`model.lora`: the checkpoint holds adapters, their Adam state and the offsets), and the killed run's last
published adapter is bit-identical to the uninterrupted run's. The trainer is started as an operator starts it on one
node, with launch/torchrun.sh, whose rendezvous stores must listen on loopback only (docs/security.md). The same
SIGKILL of a full fine-tuning trainer, at aimed phases, is `rft chaos`'s trainer-kill scenario
(tests/e2e/test_chaos.py); both share the offsets' code."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rft.schema import encode
from rft.transport import connect
from rft.transport.config import KafkaConfig
from tests.listeners import assert_none_wildcard, descendants, listeners
from tests.records import make_group
from tests.waiting import tail_of, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
STEPS, GROUPS_PER_STEP = 6, 2


def write_config(path: Path, *, run_name: str, output_dir: Path, model: Path, bootstrap: str,
                 sections: dict | None = None) -> Path:
    """The trainer's config; `sections` adds sections (or replaces whole ones)."""
    path.write_text(yaml.safe_dump({
        "run": {"name": run_name, "mode": "async", "max_steps": STEPS, "output_dir": str(output_dir),
                "groups_per_step": GROUPS_PER_STEP},
        "model": {"path": str(model)},
        "kafka": {"bootstrap_servers": bootstrap, "partitions": 1},
        "trainer": {"micro_batch_size": 4, "lr": 1e-3, "checkpoint_every": 2, "poll_timeout_s": 60},
        "monitor": {"progress": True},
        **(sections or {}),
    }))
    return path


def start_trainer(config: Path, log: Path) -> subprocess.Popen:
    """launch/torchrun.sh CONFIG: one node, --standalone, one process (TP x PP x DP = 1)."""
    return subprocess.Popen(
        ["bash", str(REPO / "launch" / "torchrun.sh"), str(config)],
        cwd=REPO, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", RFT_PYTHON=sys.executable))


def assert_loopback_stores(process: subprocess.Popen, log: Path) -> None:
    """Once torchrun's rendezvous store listens, nothing in the trainer's process tree listens on every interface."""
    assert_none_wildcard(wait_until(lambda: listeners(descendants(process.pid)) or None, timeout=120, interval=0.2,
                                    alive=[process], what="torchrun's store listening", context=tail_of(log, 3000)))


def consumed(run_dir: Path) -> list[tuple[str, int]]:
    path = run_dir / "consumed.jsonl"
    if not path.exists():
        return []
    return [(r["group_id"], r["step"]) for r in map(json.loads, path.read_text().splitlines())]


def wait(process: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"trainer did not finish in {timeout_s} s:\n{log.read_text()[-3000:]}") from None
    assert code == 0, f"trainer exited with {code}:\n{log.read_text()[-3000:]}"


def kill_and_resume(config: Path, log: Path, run_dir: Path, *, kill_after: int) -> None:
    """Start the trainer, SIGKILL it once `consumed.jsonl` has `kill_after` lines, restart it to the end."""
    process = start_trainer(config, log)
    wait_until(lambda: len(consumed(run_dir)) >= kill_after, timeout=240, interval=0.05, alive=[process],
               what=f"the trainer to consume {kill_after} groups", context=tail_of(log, 3000))
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    wait(start_trainer(config, log), log)


def test_sigkill_and_resume_trains_each_group_once(tmp_path, tiny_model, bootstrap, topic_prefix):
    sections = {"model": {"path": str(tiny_model), "lora": {"rank": 4, "alpha": 8.0}}}
    run_name = topic_prefix
    cfg = KafkaConfig(partitions=1)
    connect(cfg, bootstrap).admin().create_topics(
        [f"{run_name}.{t}" for t in ("experiences", "control", "dead_letter")])
    groups = [make_group(run_name, i, n_samples=4) for i in range(STEPS * GROUPS_PER_STEP)]
    sink = connect(cfg, bootstrap).sink()
    for i, g in enumerate(groups):
        value, headers = encode(g)
        sink.send(f"{run_name}.experiences", value, key=g.group_id, headers=headers)
        if i == 3:  # an explorer's duplicate delivery and a record that does not decode
            sink.send(f"{run_name}.experiences", value, key=g.group_id, headers=headers)
            sink.send(f"{run_name}.experiences", b"\x00not-a-record", headers=headers)
    sink.flush()

    reference_dir = tmp_path / "reference"
    config = write_config(tmp_path / "reference.yaml", run_name=run_name, output_dir=reference_dir,
                          model=tiny_model, bootstrap=bootstrap, sections=sections)
    trainer = start_trainer(config, tmp_path / "reference.log")
    assert_loopback_stores(trainer, tmp_path / "reference.log")
    wait(trainer, tmp_path / "reference.log")
    expected = consumed(reference_dir / run_name)
    assert expected == [(g.group_id, 1 + i // GROUPS_PER_STEP) for i, g in enumerate(groups)]

    killed_dir = tmp_path / "killed"
    config = write_config(tmp_path / "killed.yaml", run_name=run_name, output_dir=killed_dir, model=tiny_model,
                          bootstrap=bootstrap, sections=sections)
    kill_after = random.Random(os.getpid()).randint(1, STEPS - 2) * GROUPS_PER_STEP + random.randint(0, 1)
    kill_and_resume(config, tmp_path / "killed.log", killed_dir / run_name, kill_after=kill_after)

    assert consumed(killed_dir / run_name) == expected
    metrics = [json.loads(line) for line in (killed_dir / run_name / "metrics.jsonl").read_text().splitlines()]
    assert max(m["step"] for m in metrics) == STEPS
    assert all(m["entropy"] > 0 and m["kl"] >= 0 for m in metrics)  # logged every step (kl: behaviour k3 here)
    from safetensors.torch import load_file

    last = [load_file(d / run_name / "weights" / f"v{STEPS:08d}" / "adapter_model.safetensors")
            for d in (reference_dir, killed_dir)]
    assert sorted(last[0]) == sorted(last[1]) and all(torch.equal(last[0][k], last[1][k]) for k in last[0])
