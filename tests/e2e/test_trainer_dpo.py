"""DPO in the real trainer: 2 data-parallel ranks under torchrun, fed preference pairs from a real broker.

Checks the pieces that only meet in the trainer: the frozen reference model (at step 1 policy = reference, so every
margin is 0 and the loss is exactly log 2; at step 2 the policy has moved and the reference has not), pairs kept
whole across data-parallel ranks (a split pair makes the DPO loss raise), groups that are not pairs skipped and
counted, and the entropy and kl metrics logged every step.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rft.schema import encode
from rft.transport import connect
from rft.transport.config import KafkaConfig
from tests.records import make_group

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
STEPS, PAIRS_PER_STEP = 2, 2


def preference_groups(run_name: str) -> tuple[list, list]:
    """(pairs, groups that are not pairs): 2-sample groups with distinct random rewards; a tie; a 3-sample group."""
    pairs = [make_group(run_name, i, n_samples=2) for i in range(STEPS * PAIRS_PER_STEP)]
    tied = make_group(run_name, 100, n_samples=2)
    tied.samples[1].reward = tied.samples[0].reward
    return pairs, [tied, make_group(run_name, 101, n_samples=3)]


def test_dpo_trains_on_whole_pairs_against_a_frozen_reference(tmp_path, tiny_model, bootstrap, topic_prefix):
    run_name = topic_prefix
    connect(KafkaConfig(partitions=1), bootstrap).admin().create_topics(
        [f"{run_name}.{t}" for t in ("experiences", "control", "dead_letter")])
    pairs, not_pairs = preference_groups(run_name)
    sink = connect(KafkaConfig(partitions=1), bootstrap).sink()
    for g in [pairs[0], *not_pairs, *pairs[1:]]:
        value, headers = encode(g)
        sink.send(f"{run_name}.experiences", value, key=g.group_id, headers=headers)
    sink.flush()

    config = tmp_path / "dpo.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": run_name, "mode": "async", "max_steps": STEPS, "output_dir": str(tmp_path),
                "groups_per_step": PAIRS_PER_STEP},
        "model": {"path": str(tiny_model)},
        "kafka": {"bootstrap_servers": bootstrap, "partitions": 1},
        "algorithm": {"name": "dpo", "dpo_beta": 0.5},
        "trainer": {"data_parallel": 2, "micro_batch_size": 2, "lr": 1e-2, "checkpoint_every": STEPS,
                    "poll_timeout_s": 60},
    }))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "rft.cli", "trainer", str(config)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    run_dir = tmp_path / run_name
    trained = [json.loads(line)["group_id"] for line in (run_dir / "consumed.jsonl").read_text().splitlines()]
    assert trained == [g.group_id for g in pairs]
    step1, step2 = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert step1["skipped"] == {"tied_pair": 1, "not_a_pair": 1}
    assert abs(step1["dpo_margin"]) < 1e-6 and step1["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert abs(step2["dpo_margin"]) > 1e-4 and step2["loss"] != pytest.approx(math.log(2), rel=1e-4)
    vocab_size = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    for m in (step1, step2):
        assert 0 < m["entropy"] <= math.log(vocab_size) and m["kl"] >= 0 and m["step_skipped"] == 0.0
