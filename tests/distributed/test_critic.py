"""PPO's critic through the real megatron model (torchrun, 2 processes, gloo, the tiny model).

- Values at TP=2 and at PP=2 equal the unsharded computation: transformers' forward of the same HF directory (the
  final-norm hidden states) through a value head with the documented initialisation (normal(0, 1/sqrt(hidden)) from
  a generator seeded 0, bias 0).
- One critic step on PPO's clipped value loss: the loss, the value head's gradient (after clipping to the global
  norm) and the gradient norm over all parameters equal the unsharded autograd computation (the same loss function,
  on the transformers values).
- A critic checkpoint saved at TP=2 after a step loads at PP=2 with the stepped values, and the next step (Adam
  state restored) gives the same metrics and step count as the TP=2 critic that kept running.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rft.models.tiny import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _worker_critic as worker  # noqa: E402
import _worker_policy as cases  # noqa: E402
from _launch import run_worker_on  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return {"qwen": make_tiny_model(tmp_path_factory.mktemp("critic-model") / "qwen", seed=5)}


@pytest.fixture(scope="module")
def results(models, tmp_path_factory) -> Path:
    return run_worker_on("_worker_critic.py", tmp_path_factory.mktemp("critic-results"), models)


class UnshardedCritic:
    """transformers' trunk + the documented value head, in float32, with autograd."""

    def __init__(self, hf_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).model
        hidden = self.model.config.hidden_size
        generator = torch.Generator().manual_seed(0)
        self.weight = (torch.randn(1, hidden, generator=generator) / math.sqrt(hidden)).requires_grad_()
        self.bias = torch.zeros(1, requires_grad=True)

    def values(self, mb: dict) -> torch.Tensor:
        hidden = self.model(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).last_hidden_state
        return (hidden @ self.weight.T + self.bias)[..., 0]

    def step(self, seed: int) -> dict:
        batches = cases.micro_batches(seed=seed, vocab_size=self.model.config.vocab_size)
        with torch.no_grad():
            values = [self.values(mb) for mb in batches]
        worker.value_targets(batches, values, seed)
        loss = 0.0
        for mb in batches:
            part, _ = worker.algorithm().value_loss_fn(self.values(mb), mb)
            part.backward()
            loss += part.item()
        grads = [p.grad for p in [*self.model.parameters(), self.weight, self.bias] if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        return {"values": values, "loss": loss, "grad_norm": norm, "head": (self.weight.grad, self.bias.grad)}


@pytest.fixture(scope="module")
def unsharded(models) -> dict:
    return UnshardedCritic(models["qwen"]).step(1)


def saved(path: Path) -> list[torch.Tensor]:
    tensors = load_file(path)
    return [tensors[f"mb{i}"] for i in range(len(tensors))]


@pytest.mark.parametrize("case", ["tp2", "pp2"])
def test_values_match_the_unsharded_computation(results, unsharded, case):
    for sharded, expected in zip(saved(results / f"{case}.values.safetensors"), unsharded["values"], strict=True):
        assert expected.abs().max() > 0.1, "values must not be trivially 0"
        np.testing.assert_allclose(sharded.numpy(), expected.numpy(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["tp2", "pp2"])
def test_value_loss_gradients_match_the_unsharded_computation(results, unsharded, case):
    metrics = json.loads((results / f"{case}.metrics.json").read_text())
    assert metrics["value_clip_frac"] > 0.05, "the batch must exercise value clipping"
    assert metrics["value_loss"] == pytest.approx(unsharded["loss"], rel=1e-4)
    assert metrics["grad_norm"] == pytest.approx(unsharded["grad_norm"], rel=1e-3)
    # the head's gradient as the optimizer left it: clipped in place to the global norm grad_clip = 1 (megatron's
    # clip coefficient max_norm / (norm + 1e-6))
    clip = min(1.0, 1.0 / (unsharded["grad_norm"] + 1e-6))
    assert clip < 1.0, "the step must exercise gradient clipping"
    head = load_file(results / f"{case}.head_grad.safetensors")
    np.testing.assert_allclose(head["weight"].numpy(), clip * unsharded["head"][0].numpy(), rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(head["bias"].numpy(), clip * unsharded["head"][1].numpy(), rtol=1e-3, atol=1e-6)


def test_checkpoint_resumes_weights_and_optimizer_at_another_layout(results, unsharded):
    after = saved(results / "tp2.after.safetensors")
    resumed_values = saved(results / "resumed.values.safetensors")
    for resumed, stepped, initial in zip(resumed_values, after, unsharded["values"], strict=True):
        assert (stepped - initial).abs().max() > 1e-4, "the step must change the values"
        np.testing.assert_allclose(resumed.numpy(), stepped.numpy(), atol=2e-5, rtol=1e-4)
    continued = json.loads((results / "tp2.step2.json").read_text())
    resumed = json.loads((results / "resumed.step2.json").read_text())
    assert resumed["steps"] == continued["steps"] == 2
    for key in ("value_loss", "grad_norm", "value_mean"):
        assert resumed[key] == pytest.approx(continued[key], rel=1e-4), key
    head_continued = load_file(results / "tp2.step2.head_grad.safetensors")
    head_resumed = load_file(results / "resumed.step2.head_grad.safetensors")
    np.testing.assert_allclose(head_resumed["weight"].numpy(), head_continued["weight"].numpy(), rtol=1e-3, atol=1e-6)
