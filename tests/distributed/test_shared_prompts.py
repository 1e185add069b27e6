"""Shared prompts (`trainer.share_prompts`, megatron_bridge.shared_prompts) train exactly the padded step: two GRPO
steps at TP=2 on rows built as the trainer builds them (groups sharing a prompt, a micro-batch holding one group and
part of the next, a one-token response), once padded and once shared, give the same losses, metrics, gradient norms
and weights to float rounding, while the shared run embeds far fewer positions. The padded step itself is checked
against transformers' unsharded step in test_megatron_policy.py. Two tiny models: qwen2 (tied embeddings, qkv bias)
and llama (untied). One 2-process launch (_worker_shared_prompts.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rft.models.tiny import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_worker_on  # noqa: E402
from _weights import assert_weights_close, exported  # noqa: E402
from _worker_shared_prompts import LR  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shared-prompts")
    models = {"qwen": make_tiny_model(root / "qwen", arch="qwen2", vocab_size=101, seed=4),
              "llama": make_tiny_model(root / "llama", arch="llama", tie_word_embeddings=False, seed=5)}
    return run_worker_on("_worker_shared_prompts.py", root, models)


@pytest.mark.parametrize("model", ["qwen", "llama"])
def test_shared_prompts_train_the_padded_step(results, model):
    padded = json.loads((results / f"{model}.padded.json").read_text())
    shared = json.loads((results / f"{model}.shared.json").read_text())
    assert "prompts shared" in shared["describe"] and "prompts" not in padded["describe"]
    for p, s in zip(padded["steps"], shared["steps"], strict=True):
        assert set(p["metrics"]) == set(s["metrics"])
        for name, value in p["metrics"].items():
            assert s["metrics"][name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
        assert p["metrics"]["grad_norm"] > 0 and p["metrics"]["step_skipped"] == 0
        # the prompt runs once per micro-batch instead of once per row: 2 micro-batches x 6 rows x the longest row
        # padded; shared, each micro-batch's prompts once plus its rows' response inputs
        assert sum(s["embedded"]) < 0.6 * sum(p["embedded"]), (s["embedded"], p["embedded"])
    for step in (1, 2):  # relative error < 1e-5 per tensor (the key biases: within the noise Adam gives them)
        assert_weights_close(exported(results, f"{model}.shared.step{step}.hf"),
                             exported(results, f"{model}.padded.step{step}.hf"), lr=LR, steps=step)
