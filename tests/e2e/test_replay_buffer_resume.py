"""Prioritised replay under torchrun from a real broker: each step trains 2 fresh groups plus up to 2 replayed ones,
re-read from the topic by offset. The (group, step, reuse) sequence is exactly what a plain ReplayBuffer simulation
of the same topic predicts, every group is replayed at most `max_reuse` times and never in the step it was fresh,
and a trainer SIGKILLed at a random point and restarted trains on the same sequence."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from rft.experience.priorities import resolve_priority
from rft.trainer.replay_buffer import Candidate, ReplayBuffer
from rft.transport import connect
from rft.transport.config import KafkaConfig
from tests.e2e.test_trainer_resume import GROUPS_PER_STEP, STEPS, kill_and_resume, start_trainer, wait, write_config
from tests.records import make_group

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.integration]

REPLAYED_PER_STEP, MAX_REUSE, DECAY, SEED = 2, 2, 0.8, 3
REPLAY = {"replay_buffer": {"groups_per_step": REPLAYED_PER_STEP, "max_reuse": MAX_REUSE, "decay": DECAY,
                            "priority": "reward_variance", "seed": SEED},
          "algorithm": {"name": "grpo", "off_policy_correction": True}}


def trained(run_dir: Path) -> list[tuple[int, str, int]]:
    path = run_dir / "consumed.jsonl"
    if not path.exists():
        return []
    return [(r["step"], r["group_id"], r["reuse"]) for r in map(json.loads, path.read_text().splitlines())]


def predicted(groups, topic: str) -> list[tuple[int, str, int]]:
    """What the trainer should train on: fresh groups in log order (group i at offset i), replays as a plain
    ReplayBuffer chooses them: before the step's fresh groups join, fresh ones first in the step."""
    buffer = ReplayBuffer(max_reuse=MAX_REUSE, decay=DECAY, capacity=1024, seed=SEED)
    score, out = resolve_priority("reward_variance"), []
    for step in range(1, STEPS + 1):
        chosen = buffer.choose(REPLAYED_PER_STEP, step)
        reuse = [c.reuse + 1 for c in chosen]
        buffer.mark_replayed(chosen)
        fresh = range((step - 1) * GROUPS_PER_STEP, step * GROUPS_PER_STEP)
        buffer.add([Candidate(f"{topic}:0", i, groups[i].group_id, score(groups[i]), step) for i in fresh])
        out += [(step, groups[i].group_id, 0) for i in fresh]
        out += [(step, c.group_id, r) for c, r in zip(chosen, reuse, strict=True)]
    return out


def test_prioritised_replay_respects_reuse_and_resumes_exactly(tmp_path, tiny_model, bootstrap, topic_prefix):
    run_name, topic = topic_prefix, f"{topic_prefix}.experiences"
    cfg = KafkaConfig(partitions=1)
    connect(cfg, bootstrap).admin().create_topics(
        [f"{run_name}.{t}" for t in ("experiences", "control", "dead_letter")])
    groups = [make_group(run_name, i, n_samples=4) for i in range(STEPS * GROUPS_PER_STEP)]
    sink = connect(cfg, bootstrap).sink()
    for g in groups:
        sink.send_record(topic, g, key=g.group_id)
    sink.flush()

    reference_dir = tmp_path / "reference" / run_name
    config = write_config(tmp_path / "reference.yaml", run_name=run_name, output_dir=reference_dir.parent,
                          model=tiny_model, bootstrap=bootstrap, sections=REPLAY)
    wait(start_trainer(config, tmp_path / "reference.log"), tmp_path / "reference.log")
    expected = trained(reference_dir)
    assert expected == predicted(groups, topic)

    uses: dict[str, list[tuple[int, int]]] = {}
    for step, group, reuse in expected:
        uses.setdefault(group, []).append((step, reuse))
    assert sum(reuse > 0 for _, _, reuse in expected) >= STEPS  # replay did happen
    for group, history in uses.items():
        assert [r for _, r in history] == list(range(len(history))) and len(history) <= 1 + MAX_REUSE, group
        assert len({s for s, _ in history}) == len(history), group  # never fresh and replayed in one step
    metrics = [json.loads(line) for line in (reference_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["replay_groups"] for m in metrics] == [sum(1 for s, _, r in expected if s == step and r)
                                                     for step in range(1, STEPS + 1)]
    assert all(m["replay_staleness_max"] == (m["step"] - 1 if m["replay_groups"] else 0) for m in metrics)

    killed_dir = tmp_path / "killed" / run_name
    config = write_config(tmp_path / "killed.yaml", run_name=run_name, output_dir=killed_dir.parent,
                          model=tiny_model, bootstrap=bootstrap, sections=REPLAY)
    kill_after = random.Random(os.getpid()).randint(GROUPS_PER_STEP + 1, len(expected) - 3)
    kill_and_resume(config, tmp_path / "killed.log", killed_dir, kill_after=kill_after)
    assert trained(killed_dir) == expected
