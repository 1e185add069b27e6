"""Token-budget micro-batches (`trainer.max_tokens_per_micro_batch`) train exactly like padded fixed-shape ones.

One 2-process launch (_worker_packing.py, gloo, data parallel 2, the tiny Qwen2 model) takes one optimizer step
on the same 16 variable-length rows (GRPO, seq_mean) micro-batched two ways: padded [4, T_step] micro-batches, and
rows grouped by length under a 48-token budget. Both must give the same loss, the same metrics and the same
gradient of every parameter; and both must match the unpadded computation: transformers, each row run alone at its
own length (no padding at all), the same loss function.

Tolerance: float32 throughout. The two layouts compute the same sums in a different order (other matmul shapes,
other micro-batch partial sums, other data-parallel split), so they agree to float32 rounding, not bit for bit:
rtol 1e-5 on values of order 1, and gradients within 1e-5 of the largest gradient entry (float32's epsilon is
1.2e-7; sums over ~100 terms lose a few bits more). A padding bug (a row attending to padding, a padding token in
the loss, a wrong normaliser) changes them at the 1e-2 level or more.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rft.models.tiny import make_tiny_model
from rft.trainer.batch import plan_micro_batches

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _worker_packing as cases  # noqa: E402  (the worker's rows, loss and settings)
from _launch import HERE, assert_succeeded, torchrun  # noqa: E402

pytestmark = pytest.mark.distributed
RTOL = 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("packing-model") / "qwen", arch="qwen2", vocab_size=cases.VOCAB,
                           seed=4)


@pytest.fixture(scope="module")
def results(hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packing-results")
    assert_succeeded(torchrun([str(HERE / "_worker_packing.py"), str(hf_dir), str(out)]))
    return out


def unpadded_reference(hf_dir: Path) -> dict[str, float]:
    """transformers, one row per forward at its own length (a budget of 1 token: every row alone, no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    plan = plan_micro_batches(cases.step_rows(), dp_size=1, micro_batch_size=1, max_tokens_per_micro_batch=1)
    loss_fn, loss, kl = cases.loss_fn(), 0.0, 0.0
    batches = plan.for_rank(0)
    assert plan.padding_fraction == 0.0 and len(batches) == cases.GROUPS * cases.SAMPLES
    for mb in batches:
        logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits.float()
        token_logprobs = torch.log_softmax(logits, -1).gather(-1, mb["target_ids"][..., None])[..., 0]
        contribution, metrics = loss_fn(token_logprobs, mb)
        contribution.backward()
        loss, kl = loss + contribution.item(), kl + metrics["kl"].item()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return {"loss": loss, "kl": kl, "grad_norm": float(grad_norm)}


def read(results: Path, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    return (json.loads((results / f"{name}.metrics.json").read_text()),
            load_file(results / f"{name}.grads.safetensors"))


def test_the_budget_plan_cuts_padding_and_keeps_equal_micro_batch_counts(results):
    padded, _ = read(results, "padded")
    budget, _ = read(results, "budget")
    assert all(b == cases.PADDED_MICRO_BATCH_SIZE and t == padded["shapes"][0][0][1]
               for rank in padded["shapes"] for b, t in rank)
    assert len(budget["shapes"][0]) == len(budget["shapes"][1])
    assert all(b * t <= cases.BUDGET or b == 1 for rank in budget["shapes"] for b, t in rank)
    assert budget["padding_fraction"] < padded["padding_fraction"] / 2, (budget, padded)


def test_padded_and_token_budget_steps_have_equal_loss_and_gradients(results):
    padded, padded_grads = read(results, "padded")
    budget, budget_grads = read(results, "budget")
    for key in ("loss", "kl", "entropy", "grad_norm"):
        assert budget["metrics"][key] == pytest.approx(padded["metrics"][key], rel=RTOL), key
    assert padded_grads.keys() == budget_grads.keys() and padded_grads
    scale = max(g.abs().max() for g in padded_grads.values())
    assert scale > 0
    for name, grad in padded_grads.items():
        torch.testing.assert_close(budget_grads[name], grad, rtol=RTOL, atol=RTOL * scale, msg=name)


def test_both_match_the_unpadded_computation(hf_dir, results):
    expected = unpadded_reference(hf_dir)
    for name in ("padded", "budget"):
        metrics = read(results, name)[0]["metrics"]
        for key in ("loss", "kl", "grad_norm"):
            assert metrics[key] == pytest.approx(expected[key], rel=RTOL), (name, key, metrics[key], expected[key])
