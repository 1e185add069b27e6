"""The trainer's loop (rft/trainer/main.py) over the in-memory transport, no broker and no megatron.

Stand-ins, both allowed by the test rules: the transport is `rft.transport.memory` (an in-memory implementation of
our own RecordSink/RecordSource protocols), and the model is `StandInPolicy`, an in-memory implementation of the
policy interface the loop calls (train_step, iter_hf_buckets, checkpoints, save_hf). It records which groups each
step trained on and runs the algorithm's real loss function on the micro-batches the loop builds.

Contracts checked: each step takes exactly `groups_per_step` whole groups in topic order; a duplicate group id, a
malformed record, a foreign run's record and a group beyond the staleness bound are skipped and counted, never
trained (the first two are dead-lettered with their reasons); version s is in the weight store before its
announcement, which follows the step that made it; trainer_started comes first and trainer_finished last; and after
a crash the resumed trainer trains every group exactly once overall (consumed.jsonl, checkpointed offsets).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rft.run.config import config_from_dict
from rft.schema import HEADER_ERROR
from rft.trainer.feed import FeedTimeout
from rft.trainer.main import Trainer, open_trainer_io
from rft.transport.control import TrainerFinished, TrainerStarted, Weights, control_messages, parse
from rft.transport.memory import MemoryTransport
from rft.transport.run_topics import RunTopics, create_run_topics
from rft.weights.store import WeightStore
from tests.records import make_group, read_topic, send_groups


class Layout:
    dp_rank, dp, pp_rank, pp = 0, 1, 0, 1


class StandInPolicy:
    """The policy interface of megatron_bridge.MegatronPolicy, in memory (see the module docstring). Its one weight
    counts optimizer steps, so a published version's tensors say which step made them."""

    def __init__(self, trained: list[list[int]]):
        self.layout = Layout()
        self.trained = trained  # per train_step: the number of loss tokens of each micro-batch
        self.steps = 0

    def train_step(self, micro_batches, loss_fn):
        losses = []
        for mb in micro_batches:
            logprobs = mb["old_logprobs"].clone().requires_grad_(True)
            loss, _ = loss_fn(logprobs, mb)
            loss.backward()
            losses.append(float(loss.detach()))
        self.trained.append([int(mb["loss_mask"].sum()) for mb in micro_batches])
        self.steps += 1
        return {"loss": sum(losses)}

    def reference_logprobs(self, micro_batches):
        return [mb["old_logprobs"].clone() for mb in micro_batches]

    def describe(self) -> str:
        return "stand-in policy (tests/unit/test_trainer_loop.py)"

    def weights_finite(self) -> bool:
        return True  # its one weight counts steps

    def iter_hf_buckets(self, bucket_bytes: int, *, per_stage: bool = False):
        yield {"model.steps": torch.tensor([float(self.steps)])}

    def save_checkpoint(self, path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        (path / "policy.json").write_text(json.dumps({"steps": self.steps}))
        return path

    def load_checkpoint(self, path: Path) -> None:
        self.steps = json.loads((path / "policy.json").read_text())["steps"]

    def save_hf(self, out_dir: Path) -> Path:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        return Path(out_dir)

    def close(self) -> None:
        pass


def make_config(tmp_path: Path, *, groups_per_step: int = 2, **trainer):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": 128}))
    return config_from_dict({
        "run": {"name": "run", "mode": "off_policy", "max_staleness": 1, "max_steps": 3, "output_dir": str(tmp_path),
                "groups_per_step": groups_per_step},
        "model": {"path": str(model)},
        "kafka": {"bootstrap_servers": "memory"},
        "trainer": {"micro_batch_size": 4, "checkpoint_every": 1, "poll_timeout_s": 2.0, **trainer},
        "monitor": {"progress": False},
    })


def build(cfg, transport: MemoryTransport, trained: list, policy=None) -> Trainer:
    """A trainer of `cfg` on the in-memory `transport`, training `policy` (default: a StandInPolicy that appends
    what it trains to `trained`)."""
    return Trainer(cfg.trainer, run=cfg.run, model=cfg.model, algorithm=cfg.algorithm, sync=cfg.sync,
                   run_dir=cfg.run_dir, temperature=1.0, progress=False, policy=policy or StandInPolicy(trained),
                   open_io=lambda feed_state, replay_state: open_trainer_io(
                       cfg, feed_state=feed_state, replay_state=replay_state, transport=transport))


def fill(transport: MemoryTransport, cfg, items) -> None:
    create_run_topics(RunTopics.of(cfg), cfg.kafka, transport)
    send_groups(transport.sink(), cfg.topic("experiences"), items)


def consumed(cfg) -> list[dict]:
    return [json.loads(line) for line in (cfg.run_dir / "consumed.jsonl").read_text().splitlines()]


def test_each_step_takes_whole_fresh_groups_in_order_and_skips_what_it_must(tmp_path):
    cfg = make_config(tmp_path)
    transport = MemoryTransport(partitions=1)
    g = [make_group("run", i, n_samples=3) for i in range(6)]
    # step 1: g0, g1. Step 2: g2 (a duplicate of g1, a malformed record and a foreign group in between), g3.
    # step 3: a group from version 0 is stale there (staleness 2 > k=1), so g4, g5 (version 1).
    stale = make_group("run", 40, policy_version=0)
    g4, g5 = make_group("run", 4, policy_version=1), make_group("run", 5, policy_version=1)
    fill(transport, cfg, [g[0], g[1], g[1], b"\x93garbage", make_group("other", 9), g[2], g[3], stale, g4, g5])
    trained: list = []
    trainer = build(cfg, transport, trained)
    try:
        trainer.run()
    finally:
        trainer.close()

    rows = consumed(cfg)
    assert [(r["step"], r["group_id"]) for r in rows] == [
        (1, g[0].group_id), (1, g[1].group_id), (2, g[2].group_id), (2, g[3].group_id),
        (3, g4.group_id), (3, g5.group_id)]
    assert [r["staleness"] for r in rows] == [0, 0, 1, 1, 1, 1]
    assert len(trained) == 3 and all(sum(tokens) > 0 for tokens in trained)

    metrics = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {m["step"]: m for m in metrics if "loss" in m}
    assert by_step[2]["skipped"] == {"duplicate": 1, "dead_letter": 1, "foreign": 1}
    assert by_step[3]["dropped_stale"] == len(stale.samples)

    dead = read_topic(transport, cfg.topic("dead_letter"))  # the malformed record and the foreign group, with reasons
    assert [m.value == b"\x93garbage" for m in dead] == [True, False]
    assert all(dict(m.headers)[HEADER_ERROR] for m in dead) and b"foreign" in dict(dead[1].headers)[HEADER_ERROR]

    kinds = [parse(m) for m in control_messages(read_topic(transport, cfg.topic("control")))]
    assert isinstance(kinds[0], TrainerStarted) and isinstance(kinds[-1], TrainerFinished)
    announced = [k.version for k in kinds if isinstance(k, Weights)]
    assert announced == [0, 1, 2, 3]
    store = WeightStore.for_sync(cfg.sync, cfg.run_dir)
    assert store.latest()[0] == 3
    # the newest version's tensors were made by step 3 (a version is published after the step that made it)
    steps = dict(store.iter_tensors(3))["model.steps"]
    assert float(steps[0]) == 3.0


def test_a_resumed_trainer_trains_every_group_exactly_once(tmp_path):
    cfg = make_config(tmp_path, groups_per_step=2)
    transport = MemoryTransport(partitions=1)
    groups = [make_group("run", i, n_samples=2, policy_version=i // 3) for i in range(6)]  # in bound at steps 1-3
    fill(transport, cfg, groups[:3])  # only enough for one step and a half: the second step starves

    trained: list = []
    starving = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, poll_timeout_s=0.5))
    first = build(starving, transport, trained)
    with pytest.raises(FeedTimeout):
        first.run()  # step 1, then step 2 times out with g2 taken but not trained: the trainer dies here
    first.io.close()
    assert [r["step"] for r in consumed(cfg)] == [1, 1]

    fill(transport, cfg, groups[3:])
    resumed = build(cfg, transport, trained)
    assert resumed.step == 1
    try:
        resumed.run()
    finally:
        resumed.close()
    rows = consumed(cfg)
    assert [r["group_id"] for r in rows] == [g.group_id for g in groups]
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3]
    assert np.all(np.diff([r["step"] for r in rows]) >= 0)


def test_failed_samples_are_not_trained_and_are_counted_per_class_in_the_metrics(tmp_path):
    """gigpo (per-token advantages from the samples' turns) on groups with failed rollouts: a failed sample is
    neither trained nor in its baseline, a group left with one scored sample is dropped, every count in metrics."""
    from rft.schema import Turn
    cfg = dataclasses.replace(make_config(tmp_path), algorithm=config_from_dict({
        "model": {"path": str(tmp_path / "model")}, "algorithm": {"name": "gigpo"}}).algorithm)
    groups = [make_group("run", i, rewards=[1.0, 0.0, 0.5, 0.0], response_len=6, policy_version=int(i >= 5))
              for i in range(7)]  # step 3's groups from version 1: within the staleness bound
    for g in groups:
        for s in g.samples:
            s.turns = [Turn(0, 3, "start", 0.0), Turn(3, 6, f"s{s.sample_index % 2}", s.reward)]
    groups[0].samples[1].failure = "timeout"  # step 1: 3 + 4 samples
    groups[2].samples[0].failure = groups[2].samples[1].failure = groups[2].samples[2].failure = "verifier"
    groups[3].samples[3].failure = "unscored"  # step 2: groups 2 (dropped: 1 scored), 3 (3 samples), 4
    fill(transport := MemoryTransport(partitions=1), cfg, groups)
    trained: list = []
    trainer = build(cfg, transport, trained)
    try:
        trainer.run()
    finally:
        trainer.close()
    assert [sum(tokens) for tokens in trained] == [6 * 7, 6 * 7, 6 * 8]  # loss tokens: scored samples only
    metrics = {m["step"]: m for m in (json.loads(line) for line in
                                      (cfg.run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in m}
    assert metrics[1]["samples"] == 7 and metrics[1]["failed_timeout"] == 1 and metrics[1]["failed_verifier"] == 0
    assert metrics[2]["skipped"] == {"too_few_scored": 1} and metrics[2]["failed_groups_dropped"] == 1
    assert (metrics[2]["failed_verifier"], metrics[2]["failed_unscored"]) == (3, 1)
    assert {k: metrics[3][k] for k in ("failed_timeout_total", "failed_verifier_total", "failed_unscored_total",
                                       "failed_groups_dropped_total")} == {
        "failed_timeout_total": 1, "failed_verifier_total": 3, "failed_unscored_total": 1,
        "failed_groups_dropped_total": 1}
