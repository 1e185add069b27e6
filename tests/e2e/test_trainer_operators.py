"""The trainer under torchrun with experience operators, fed from a real broker: groups without reward variance are
dropped and counted per step in metrics.jsonl (`dropped/zero_variance`), never trained on, and the rewards trained
on (`reward_mean`) are the shaped ones, checked against a plain computation. Run as DAPO (GRPO with clip-higher,
token-level loss, overlong shaping, dynamic sampling; docs/algorithms.md) and with GSPO's sequence-level loss."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from rft.schema import encode
from rft.transport import connect
from rft.transport.config import KafkaConfig
from tests.e2e.test_trainer_resume import consumed, start_trainer, wait
from tests.records import make_group

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.integration]

START, END, PENALTY = 2, 6, 0.5


ALGORITHMS = {"dapo": {"name": "grpo", "clip_eps_high": 0.28, "loss_agg": "token_mean"},
              "gspo": {"name": "gspo"}}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_trainer_drops_and_shapes_groups(tmp_path, tiny_model, bootstrap, topic_prefix, algorithm):
    run_name = topic_prefix
    cfg = KafkaConfig(partitions=1)
    connect(cfg, bootstrap).admin().create_topics(
        [f"{run_name}.{t}" for t in ("experiences", "control", "dead_letter")])
    lengths = [[1, 3, 5, 8], [2, 4, 6, 7]]
    useful = [make_group(run_name, i, rewards=[0.0, 1.0, 0.5, 1.0],
                         responses=[[5 + i] * n for n in lengths[i % 2]]) for i in range(6)]
    flat = [make_group(run_name, 100 + i, rewards=[1.0] * 4) for i in range(4)]
    # steps of 2 groups: [u0 f0 u1] [f1 f2 u2 u3] [u4 f3 u5]
    order = [useful[0], flat[0], useful[1], flat[1], flat[2], useful[2], useful[3], useful[4], flat[3], useful[5]]
    sink = connect(cfg, bootstrap).sink()
    for g in order:
        value, headers = encode(g)
        sink.send(f"{run_name}.experiences", value, key=g.group_id, headers=headers)
    sink.flush()
    sink.close()

    run_dir = tmp_path / "runs"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": run_name, "mode": "async", "max_steps": 3, "output_dir": str(run_dir), "groups_per_step": 2},
        "model": {"path": str(tiny_model)},
        "kafka": {"bootstrap_servers": bootstrap, "partitions": 1}, "algorithm": ALGORITHMS[algorithm],
        "trainer": {"micro_batch_size": 4, "checkpoint_every": 100, "poll_timeout_s": 60,
                    "operators": ["zero_variance", {"name": "length_penalty", "start": START, "end": END,
                                                    "penalty": PENALTY}]},
        "monitor": {"progress": False},
    }))
    log = tmp_path / "trainer.log"
    wait(start_trainer(config, log), log)

    assert consumed(run_dir / run_name) == [(g.group_id, 1 + i // 2) for i, g in enumerate(useful)]
    metrics = [json.loads(line) for line in (run_dir / run_name / "metrics.jsonl").read_text().splitlines()]
    assert [m["dropped/zero_variance"] for m in metrics] == [1, 2, 1]
    for step, m in enumerate(metrics):
        shaped = [s.reward - PENALTY * np.clip((len(s.response_tokens) - START) / (END - START), 0, 1)
                  for g in useful[2 * step:2 * step + 2] for s in g.samples]
        assert m["reward_mean"] == pytest.approx(np.mean(shaped), abs=1e-9)
        assert "dropped/zero_variance" not in m["skipped"]
        assert np.isfinite(m["loss"]) and 0 <= m["clip_frac"] <= 1
        if algorithm == "gspo":  # its own metric reaches metrics.jsonl
            assert np.isfinite(m["seq_ratio_mean"]) and m["seq_ratio_mean"] > 0
