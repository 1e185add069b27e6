"""`rft replay`: offline training from a recorded topic by offset range; two replays of the same range train on
exactly the same records, in the same steps."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rft.transport import connect
from rft.transport.config import KafkaConfig
from tests.records import make_group

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]


def replay(tmp_path: Path, name: str, *, model: Path, bootstrap: str, topic: str, start: str, end: str) -> Path:
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": name, "max_steps": 50, "output_dir": str(tmp_path / "runs"), "groups_per_step": 2},
        "model": {"path": str(model)},
        "kafka": {"bootstrap_servers": bootstrap},
        "trainer": {"micro_batch_size": 8, "lr": 1e-3, "checkpoint_every": 100},
        "algorithm": {"name": "sft"},
    }))
    result = subprocess.run([sys.executable, "-m", "rft.cli", "replay", str(config), "--topic", topic,
                             "--from", start, "--to", end], cwd=REPO, capture_output=True, text=True, timeout=400)
    run_dir = tmp_path / "runs" / name
    log = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{log[-3000:]}"
    return run_dir


def consumed(run_dir: Path) -> list[tuple[str, int]]:
    return [(r["group_id"], r["step"]) for r in map(json.loads, (run_dir / "consumed.jsonl").read_text().splitlines())]


def test_replaying_a_range_twice_trains_on_the_same_records(tmp_path, tiny_model, bootstrap, topic_prefix):
    cfg = KafkaConfig(partitions=1)
    topic = f"{topic_prefix}.experiences"
    connect(cfg, bootstrap).admin().create_topics([topic], partitions=1)
    groups = [make_group("recorded-run", i, policy_version=i // 2) for i in range(10)]
    sink = connect(cfg, bootstrap).sink()
    for g in groups:
        sink.send_record(topic, g, key=g.group_id)
    sink.flush()

    first = replay(tmp_path, "replay-a", model=tiny_model, bootstrap=bootstrap, topic=topic, start="0:2", end="0:7")
    second = replay(tmp_path, "replay-b", model=tiny_model, bootstrap=bootstrap, topic=topic, start="0:2", end="0:7")
    expected = [(g.group_id, 1 + i // 2) for i, g in enumerate(groups[2:7])]  # the last step has one group
    assert consumed(first) == expected
    assert consumed(second) == expected
    assert (first / "final" / "config.json").exists()
    metrics = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["loss"] > 0 for m in metrics)
