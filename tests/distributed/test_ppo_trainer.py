"""ppo through the trainer's loop with the real megatron policy and critic (torchrun, 2 processes, data parallel 2,
gloo, the tiny model; experiences from the in-memory transport, see _worker_ppo_trainer.py).

- Each step logs the critic's metrics beside the policy's (value_loss, critic_grad_norm, ...).
- The critic is checkpointed with the policy in the step's directory and restored on resume: a trainer that stops
  after step 1 and is resumed ends step 2 with the same critic values and policy log-probs as a trainer that ran both
  steps, and every group is trained exactly once (consumed.jsonl).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from rft.models.tiny import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_worker_on  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    model = make_tiny_model(tmp_path_factory.mktemp("ppo-model") / "qwen", seed=6)
    return run_worker_on("_worker_ppo_trainer.py", tmp_path_factory.mktemp("ppo-results"), {"qwen": model})


def saved(path: Path) -> list:
    tensors = load_file(path)
    return [tensors[f"mb{i}"].numpy() for i in range(len(tensors))]


def step_metrics(run_dir: Path) -> list[dict]:
    return [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "value_loss" in m]


def test_steps_log_the_critics_metrics(results):
    metrics = step_metrics(results / "straight" / "run")
    assert len(metrics) == 2
    for m in metrics:
        assert m["value_loss"] > 0 and np.isfinite(m["critic_grad_norm"]) and m["critic_grad_norm"] > 0
        assert m["critic_step_skipped"] == 0.0 and "value_clip_frac" in m and "loss" in m


def test_resume_restores_policy_and_critic_and_trains_each_group_once(results):
    after_resume = json.loads((results / "resumed.json").read_text())
    assert after_resume == {"step": 1, "critic_steps": 1, "policy_steps": 1}
    for key in ("values", "logprobs"):
        for resumed, straight in zip(saved(results / f"resumed.{key}.safetensors"),
                                     saved(results / f"straight.{key}.safetensors"), strict=True):
            np.testing.assert_allclose(resumed, straight, atol=1e-5, rtol=1e-5, err_msg=key)
    assert (results / "resumed" / "run").is_dir()
    consumed = [json.loads(line) for line in (results / "resumed" / "run" / "consumed.jsonl").read_text().splitlines()]
    straight = [json.loads(line) for line in (results / "straight" / "run" / "consumed.jsonl").read_text().splitlines()]
    assert [r["group_id"] for r in consumed] == [r["group_id"] for r in straight] and len(consumed) == 4
    assert [r["step"] for r in consumed] == [1, 1, 2, 2]
    checkpoints = sorted(p.name for p in (results / "resumed" / "run").rglob("critic") if p.is_dir())
    assert checkpoints, "the critic must be checkpointed in the step directories"
