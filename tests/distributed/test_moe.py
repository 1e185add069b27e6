"""Mixtures of experts in the trainer's policy under torchrun with gloo: training with expert parallelism, the
router's load-balancing and z-loss reported per step, and checkpoints that reshard across TP / PP / EP.

One 2-process launch (_worker_moe.py) runs every case and writes its results; the assertions are here.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rft.models.tiny import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_worker_on  # noqa: E402
from _worker_policy import micro_batches  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Qwen3-MoE: 4 layers, 4 experts (2 per rank at EP 2), top 2. Qwen2-MoE: 2 layers, shared expert."""
    root = tmp_path_factory.mktemp("moe-models")
    return {"qwen3_moe": make_tiny_model(root / "qwen3_moe", arch="qwen3_moe", layers=4, seed=11),
            "qwen2_moe": make_tiny_model(root / "qwen2_moe", arch="qwen2_moe", layers=2, seed=12)}


@pytest.fixture(scope="module")
def results(models, tmp_path_factory) -> Path:
    return run_worker_on("_worker_moe.py", tmp_path_factory.mktemp("moe-results"), models)


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def metrics(results: Path, case: str) -> dict:
    return json.loads((results / f"{case}.metrics.json").read_text())


def test_expert_parallel_training_reports_router_losses_every_step(results):
    report = metrics(results, "q3_ep2")
    assert report["layout"] == [1, 1, 2, 2]  # tp, pp, dp, ep
    for step in ("step1", "step2"):
        values = report["rank0"][step]
        assert values["step_skipped"] == 0.0 and math.isfinite(values["loss"])
        # switch load-balancing loss: 1 when perfectly balanced, up to the expert count; z-loss: mean of
        # logsumexp(router logits)^2, near (ln 4)^2 = 1.92 for small random router logits over 4 experts
        assert 0.9 < values["moe_load_balancing_loss"] < 4.0, values
        assert 1.0 < values["moe_z_loss"] < 3.0, values
    assert report["rank0"]["step1"]["moe_z_loss"] != report["rank0"]["step2"]["moe_z_loss"]


def test_the_same_steps_at_tp2_report_the_same_metrics_as_at_ep2(results):
    """Loss, gradient norm (router losses' gradients included) and both router losses agree between EP 2 x DP 2 and
    TP 2 with sequence parallelism: the losses' scaling does not depend on the layout."""
    ep2, tp2 = metrics(results, "q3_ep2")["rank0"], metrics(results, "q3_tp2_fresh")["rank0"]
    for step in ("step1", "step2"):
        for name in ("loss", "grad_norm", "moe_load_balancing_loss", "moe_z_loss"):
            assert tp2[step][name] == pytest.approx(ep2[step][name], rel=1e-5), (step, name)


def test_training_moves_the_router_and_the_experts_of_both_expert_parallel_ranks(results, models):
    before, after = hf_tensors(models["qwen3_moe"]), hf_tensors(results / "q3_ep2.hf")
    assert sorted(before) == sorted(after)
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.2.mlp.experts.0.up_proj.weight",
                 "model.layers.2.mlp.experts.3.down_proj.weight", "model.layers.3.self_attn.q_norm.weight"):
        assert not torch.equal(before[name], after[name]), name


@pytest.mark.parametrize("case", ["q3_tp2", "q3_pp2"])
def test_checkpoint_saved_at_ep2_loads_at_another_layout(results, case):
    """Saved at tp1 pp1 ep2, loaded at tp2 (sequence parallel, experts split over TP) and at pp2: the same
    weights, bit for bit, and the same log-probabilities."""
    saved, loaded = hf_tensors(results / "q3_ep2.hf"), hf_tensors(results / f"{case}.hf")
    assert sorted(saved) == sorted(loaded)
    for name, tensor in saved.items():
        assert torch.equal(tensor, loaded[name]), name
    reference = load_file(results / "q3_ep2.after.safetensors")  # data-parallel rank 0's micro-batches
    other = load_file(results / f"{case}.after.safetensors")
    for key, values in reference.items():
        assert (values - other[key]).abs().max().item() < 1e-5, key


def test_trained_export_matches_transformers_log_probabilities(results):
    """The exported MoE, read by transformers, gives the log-probabilities megatron computed at ep2."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(results / "q3_ep2.hf", dtype=torch.float32).eval()
    saved = load_file(results / "q3_ep2.after.safetensors")
    batches = micro_batches(3, model.config.vocab_size)
    for i, mb in enumerate(batches[:len(saved)]):
        with torch.no_grad():
            logits = model(input_ids=mb["input_ids"]).logits
        expected = torch.log_softmax(logits, dim=-1).gather(-1, mb["target_ids"][..., None])[..., 0]
        assert (expected - saved[f"mb{i}"]).abs().max().item() < 1e-4, i


def test_qwen2_moe_with_shared_expert_trains_at_pp2_and_reloads_at_ep2(results, models):
    report = metrics(results, "q2_pp2")
    assert report["layout"] == [1, 2, 1, 1]
    assert 0.9 < report["rank0"]["step1"]["moe_load_balancing_loss"] < 4.0
    trained, reloaded = hf_tensors(results / "q2_pp2.hf"), hf_tensors(results / "q2_ep2.hf")
    assert sorted(trained) == sorted(reloaded)
    assert all(torch.equal(trained[name], reloaded[name]) for name in trained)
    original = hf_tensors(models["qwen2_moe"])
    for name in ("model.layers.1.mlp.shared_expert_gate.weight", "model.layers.1.mlp.shared_expert.up_proj.weight"):
        assert not torch.equal(original[name], trained[name]), name
