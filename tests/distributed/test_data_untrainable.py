"""Issue 29, items 3 and 4, with a real broker and the real trainer (`rft trainer` under torchrun: 2 processes, data
parallel 2, gloo, the tiny model): records that decode but cannot be trained do not crash it, nor crash-loop it.

One experiences topic, in this order:
  step 1: g0, a group with a token id past the vocabulary (crashed the embedding lookup), a group with a reward of
          1e308 (poisoned GRPO's advantages), g1;
  step 2: g2 (one sample's recorded log-probs of -1e30 with a negative advantage: the clipped objective is infinite,
          so the loss and the gradients are not finite), g3;
  step 3 (after a restart with run.max_steps 3): g4, g5.
The trainer trains steps 1 and 2, dead-letters the two untrainable groups with their reasons (the records
themselves, byte for byte), skips step 2's optimizer update (megatron_bridge: non-finite loss) and counts it,
publishes only finite weights; restarted from its step-2 checkpoint, it goes on to step 3 without meeting the
dead-lettered records again (their offsets were consumed like any record's).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from rft.schema import HEADER_ERROR, decode_group
from rft.transport import connect
from rft.transport.run_topics import RunTopics, create_run_topics
from rft.weights.store import WeightStore, iter_safetensors
from tests.records import make_group, send_groups

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import REPO, assert_succeeded  # noqa: E402

pytestmark = pytest.mark.distributed


def trainer(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "rft.cli",
               "trainer", str(config), *[a for o in overrides for a in ("--set", o)]]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def run(broker, tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("untrainable")
    name = f"untrainable-{uuid.uuid4().hex[:8]}"
    body = {"run": {"name": name, "mode": "train", "max_steps": 2, "output_dir": str(tmp), "groups_per_step": 2},
            "model": {"path": str(tiny_model), "max_prompt_len": 16, "max_response_len": 16},
            "kafka": {"bootstrap_servers": broker.bootstrap_servers, "partitions": 1},
            "trainer": {"micro_batch_size": 4, "checkpoint_every": 1, "poll_timeout_s": 60, "data_parallel": 2,
                        "lr": 1e-3},
            "sync": {"write_behind": False}, "monitor": {"progress": False}}
    config = tmp / "run.yaml"
    config.write_text(yaml.safe_dump(body))
    from rft.run.config import load_config
    cfg = load_config(config)
    vocab = json.loads((Path(tiny_model) / "config.json").read_text())["vocab_size"]
    g = [make_group(name, i, n_samples=4, prompt_len=4, response_len=5) for i in range(6)]
    past_vocab = make_group(name, 10, n_samples=4, prompt_len=4, response_len=5)
    past_vocab.samples[2].response_tokens = past_vocab.samples[2].response_tokens.copy()
    past_vocab.samples[2].response_tokens[1] = vocab + 7
    poisoned = make_group(name, 11, rewards=[1e308, 1e308, 0.0, 0.0], prompt_len=4, response_len=5)
    g[2] = make_group(name, 2, rewards=[1.0, 0.0, 0.0, 0.0], prompt_len=4, response_len=5)
    g[2].samples[1].logprobs = np.full_like(g[2].samples[1].logprobs, -1e30)  # negative advantage: an infinite loss
    transport = connect(cfg.kafka)
    create_run_topics(RunTopics.of(cfg), cfg.kafka, transport)
    sink = transport.sink()
    send_groups(sink, cfg.topic("experiences"), [g[0], past_vocab, poisoned, g[1], g[2], g[3]])
    sink.flush()
    first = trainer(config)
    send_groups(sink, cfg.topic("experiences"), [g[4], g[5]])
    sink.flush()
    sink.close()
    resumed = trainer(config, "run.max_steps=3")
    return cfg, first, resumed, {"past_vocab": past_vocab, "poisoned": poisoned, "g": g, "vocab": vocab}


def test_the_trainer_goes_on_past_untrainable_groups_and_dead_letters_them(run):
    cfg, first, resumed, groups = run
    assert_succeeded(first)
    assert_succeeded(resumed)
    consumed = [json.loads(line) for line in (cfg.run_dir / "consumed.jsonl").read_text().splitlines()]
    assert [(r["step"], r["group_id"]) for r in consumed] == [
        (s, groups["g"][i].group_id) for s, i in ((1, 0), (1, 1), (2, 2), (2, 3), (3, 4), (3, 5))]
    source = connect(cfg.kafka).source()
    try:
        dead = list(source.read_range(cfg.topic("dead_letter"), idle_timeout_s=3.0))
    finally:
        source.close()
    assert len(dead) == 2, [dict(m.headers).get(HEADER_ERROR) for m in dead]  # the restart did not meet them again
    by_id = {decode_group(m.value, m.headers).group_id: dict(m.headers)[HEADER_ERROR].decode() for m in dead}
    assert by_id[groups["past_vocab"].group_id] == (
        f"cannot be trained: samples[2]: response token id {groups['vocab'] + 7} is outside the vocabulary "
        f"[0, {groups['vocab']})")
    assert by_id[groups["poisoned"].group_id].startswith("cannot be trained: samples[0]: reward 1e+308 is outside")


def test_a_step_with_an_infinite_loss_is_skipped_counted_and_no_poisoned_weights_are_published(run):
    cfg, first, resumed, _ = run
    assert_succeeded(first)
    metrics = {m["step"]: m for m in map(json.loads, (cfg.run_dir / "metrics.jsonl").read_text().splitlines())
               if "step" in m}
    assert metrics[1]["skipped"] == {"untrainable": 2} and metrics[1]["step_skipped"] == 0.0
    assert metrics[2]["step_skipped"] == 1.0 and metrics[2]["loss"] is None  # NaN / inf: written as null
    assert [metrics[s]["steps_skipped_total"] for s in (1, 2, 3)] == [0, 1, 1]
    assert metrics[3]["step_skipped"] == 0.0 and np.isfinite(metrics[3]["loss"])
    store = WeightStore.for_sync(cfg.sync, cfg.run_dir)
    version, path = store.latest()
    assert version == 3
    for name, tensor in iter_safetensors(path):
        assert bool(torch.isfinite(tensor).all()), name
