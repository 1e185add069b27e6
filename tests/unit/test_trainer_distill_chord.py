"""on_policy_distill and chord through the trainer's loop (rft/trainer/main.py) over the in-memory transport, with
test_trainer_loop.py's stand-in policy (it runs the algorithm's real loss on the micro-batches the loop builds, with the
behaviour log-probs as the current policy's; here its teacher scores every token 0.5 nats below them).

Checked: on_policy_distill's micro-batches carry the policy's teacher_logprobs, and the step loss is the mean per-token
gap (0.5 at rho = 1). chord: each step mixes up to `chord_groups_per_step` demonstration groups from the demonstrations
topic into its `groups_per_step` policy groups, as rows with `demo_mask` 1 and the step's counts; the step's loss is
(1 - mu) * L_grpo + mu * L_sft computed independently in NumPy from the groups; when the topic is used up the steps go
on without demonstrations; the demonstrations feed's offsets are checkpointed, so a resumed trainer takes only
demonstrations it has not trained on.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_trainer_loop import StandInPolicy, consumed, fill

from rft.run.config import config_from_dict
from rft.trainer.main import Trainer, open_trainer_io
from rft.transport.memory import MemoryTransport
from tests.records import make_group, send_groups

MU = {1: 0.9, 2: 0.5, 3: 0.1, 4: 0.1}  # linear from 0.9 to 0.1 over 2 steps
TEACHER_GAP = 0.5


class RecordingPolicy(StandInPolicy):
    def __init__(self, trained: list, batches: list):
        super().__init__(trained)
        self.batches = batches

    def train_step(self, micro_batches, loss_fn):
        self.batches.append(micro_batches)
        return super().train_step(micro_batches, loss_fn)

    def teacher_logprobs(self, micro_batches):
        return [(mb["old_logprobs"] - TEACHER_GAP) * mb["loss_mask"] for mb in micro_batches]


def chord_config(tmp_path: Path, *, max_steps: int, algorithm: dict | None = None):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": 128}))
    return config_from_dict({
        "run": {"name": "run", "mode": "train", "max_steps": max_steps, "output_dir": str(tmp_path),
                "groups_per_step": 2},
        "model": {"path": str(model)},
        "kafka": {"bootstrap_servers": "memory"},
        "algorithm": algorithm or {"name": "chord", "chord_groups_per_step": 2, "chord_mu_start": 0.9,
                                   "chord_mu_end": 0.1, "chord_mu_steps": 2, "chord_mu_schedule": "linear"},
        "trainer": {"micro_batch_size": 3, "checkpoint_every": 1, "poll_timeout_s": 2.0},
        "monitor": {"progress": False},
    })


def build(cfg, transport, trained, batches) -> Trainer:
    return Trainer(cfg.trainer, run=cfg.run, model=cfg.model, algorithm=cfg.algorithm, sync=cfg.sync,
                   run_dir=cfg.run_dir, temperature=1.0, progress=False, policy=RecordingPolicy(trained, batches),
                   open_io=lambda feed_state, replay_state: open_trainer_io(
                       cfg, feed_state=feed_state, replay_state=replay_state, transport=transport))


def run(trainer: Trainer) -> None:
    try:
        trainer.run()
    finally:
        trainer.close()


def expected_loss(groups, demos, mu: float) -> float:
    """token_mean on each part; current = behaviour log-probs, so rho = 1 and the GRPO term is -A_i per token."""
    rl_tokens = sum(s.loss_mask.sum() for g in groups for s in g.samples)
    rl = 0.0
    for g in groups:
        r = np.array([s.reward for s in g.samples], np.float64)
        advantages = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
        rl += sum(-a * s.loss_mask.sum() for a, s in zip(advantages, g.samples, strict=True))
    demo_samples = [s for g in demos for s in g.samples]
    demo_tokens = sum(s.loss_mask.sum() for s in demo_samples)
    sft = -sum(float((s.logprobs * s.loss_mask).sum()) for s in demo_samples) / max(demo_tokens, 1)
    return (1 - mu) * rl / rl_tokens + mu * sft


def test_distill_micro_batches_carry_the_teachers_logprobs(tmp_path):
    cfg = chord_config(tmp_path, max_steps=2, algorithm={"name": "on_policy_distill", "teacher_path": "/teacher",
                                                         "distill_coef": 2.0})
    transport = MemoryTransport(partitions=1)
    fill(transport, cfg, [make_group("run", i, n_samples=3) for i in range(4)])
    trained, batches = [], []
    run(build(cfg, transport, trained, batches))
    assert len(batches) == 2
    for mbs in batches:
        for mb in mbs:
            np.testing.assert_array_equal(mb["teacher_logprobs"], (mb["old_logprobs"] - TEACHER_GAP) * mb["loss_mask"])
    metrics = [m for m in map(json.loads, (cfg.run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert [m["loss"] for m in metrics] == pytest.approx([2.0 * TEACHER_GAP] * 2, rel=1e-6)


def test_chord_mixes_demonstrations_into_steps_and_resumes_exactly_once(tmp_path):
    cfg = chord_config(tmp_path, max_steps=3)
    transport = MemoryTransport(partitions=1)
    groups = [make_group("run", i, seed=i, rewards=[float(i % 2), 1.0, 0.5 * i],
                         responses=[[5] * 3, [6] * (4 + i % 3), [7] * 6]) for i in range(8)]  # lengths differ
    demos = [make_group("experts", 100 + i, n_samples=1, response_len=4 + i) for i in range(3)]
    fill(transport, cfg, groups[:6])
    transport.admin().create_topics(["run.demonstrations"])
    send_groups(transport.sink(), "run.demonstrations", demos)
    trained, batches = [], []
    run(build(cfg, transport, trained, batches))

    assert [r["group_id"] for r in consumed(cfg)] == [g.group_id for g in groups[:6]]  # demonstrations: not here
    metrics = [m for m in map(json.loads, (cfg.run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert [m["demonstrations"] for m in metrics] == [2, 1, 0]
    assert [m["sft_mu"] for m in metrics] == pytest.approx([MU[1], MU[2], MU[3]])
    step_demos = [demos[:2], demos[2:], []]
    for step, (mbs, m) in enumerate(zip(batches, metrics, strict=True), start=1):
        mine = step_demos[step - 1]
        assert sum(float(mb["demo_mask"].sum()) for mb in mbs) == len(mine)
        assert all(float(mb["step"]) == step for mb in mbs)
        assert float(mbs[0]["global_demo_tokens"]) == sum(s.loss_mask.sum() for g in mine for s in g.samples)
        assert m["loss"] == pytest.approx(expected_loss(groups[2 * step - 2:2 * step], mine, MU[step]), rel=1e-5)
    state = json.loads((sorted((cfg.run_dir / "checkpoints").glob("step_*"))[-1] / "trainer_state.json").read_text())
    assert state["demonstrations"]["offsets"] == {"run.demonstrations:0": 3}

    more = [make_group("experts", 200, n_samples=1)]
    send_groups(transport.sink(), "run.demonstrations", more)
    fill(transport, cfg, groups[6:])
    resumed_cfg = chord_config(tmp_path, max_steps=4)
    batches.clear()
    run(build(resumed_cfg, transport, trained, batches))
    assert len(batches) == 1  # step 4 only
    metrics = [m for m in map(json.loads, (cfg.run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert metrics[-1]["step"] == 4 and metrics[-1]["demonstrations"] == 1
    assert metrics[-1]["loss"] == pytest.approx(expected_loss(groups[6:], more, MU[4]), rel=1e-5)
