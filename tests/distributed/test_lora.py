"""LoRA in the megatron trainer against independent code (issue 27): the `peft` library on transformers.

One 2-process launch (_worker_lora.py) trains a LoRA policy one step at TP=2, PP=2 and DP=2 from the same PEFT
adapter; here the reference is that adapter loaded by peft onto the base model in transformers:
- the trainer's log-probabilities equal peft's, before the step and, from the adapter it published to a weight
  store (PEFT layout: adapter_config.json + adapter_model.safetensors, checked against its manifest), after it;
- the merged export equals the published adapter on the base;
- the adapters' gradients at TP=2, PP=2 and DP=2 equal peft's (a shared A's gradient is the sum of its q, k, v
  or gate, up gradients), so the three layouts equal unsharded LoRA and each other;
- megatron's optimizer and DDP buffers hold the adapters only, and a checkpoint saved at TP=2 reloads at PP=2
  with the same adapters and Adam state (its next step equals the uninterrupted one).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rft.models.tiny import make_tiny_model
from tests.lora_adapters import SHARED, TARGETS, make_peft_adapter, peft_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _worker_lora as cases  # noqa: E402
from _launch import run_worker_on  # noqa: E402
from _worker_policy import micro_batches, token_mean_nll  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen2 (q/k/v biases, tied embeddings) and a PEFT adapter on it with random A (shared where megatron
    fuses) and B."""
    root = tmp_path_factory.mktemp("lora")
    model_dir = make_tiny_model(root / "qwen", arch="qwen2", vocab_size=101, seed=7)
    adapter = make_peft_adapter(model_dir, root / "adapter", rank=cases.RANK, alpha=cases.ALPHA, seed=3)
    return {"model": model_dir, "adapter": adapter}


@pytest.fixture(scope="module")
def results(setup, tmp_path_factory) -> Path:
    return run_worker_on("_worker_lora.py", tmp_path_factory.mktemp("lora-results"), setup)


def token_logprobs(model, mb: dict) -> torch.Tensor:
    logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits.float()
    return torch.log_softmax(logits, dim=-1).gather(-1, mb["target_ids"][..., None])[..., 0]


def assert_logprobs(saved: Path, model, batches: list[dict]) -> None:
    values = load_file(saved)
    with torch.no_grad():
        for i, mb in enumerate(batches):
            mask = mb["loss_mask"] > 0
            torch.testing.assert_close(values[f"mb{i}"][mask], token_logprobs(model, mb)[mask], rtol=0, atol=2e-5)


def reference_gradients(setup, batches: list[dict]) -> dict[str, torch.Tensor]:
    """peft's adapter gradients of the step's loss in PEFT names; a shared A's is the sum over its sharers."""
    model = peft_model(setup["model"], setup["adapter"])
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    for mb in batches:
        token_mean_nll(token_logprobs(model, mb), mb)[0].backward()
    grads = {name.replace(".default", ""): p.grad for name, p in model.named_parameters() if p.grad is not None}
    for name in list(grads):
        for source in set(SHARED.values()):
            if f".{source}.lora_A" in name:
                names = [name] + [name.replace(f".{source}.", f".{s}.") for s, of in SHARED.items() if of == source]
                total = sum(grads[n] for n in names)
                grads.update(dict.fromkeys(names, total))
    return grads


def test_logprobs_equal_peft_before_and_after_the_step(setup, results):
    from rft.weights.store import ADAPTER_CONFIG, ADAPTER_FILE, verify_version

    batches = micro_batches(1, 101)
    assert_logprobs(results / "tp2.before.safetensors", peft_model(setup["model"], setup["adapter"]), batches)
    version = results / "tp2.store" / "v00000001"
    verify_version(version, 1)
    assert sorted(p.name for p in version.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_FILE, "rft-manifest.json"])
    assert json.loads((version / ADAPTER_CONFIG).read_text())["target_modules"] == sorted(TARGETS)
    published = peft_model(setup["model"], version)
    assert_logprobs(results / "tp2.after.safetensors", published, batches)
    before = load_file(setup["adapter"] / ADAPTER_FILE)
    after = load_file(version / ADAPTER_FILE)
    assert sorted(after) == sorted(before)
    assert any(not torch.equal(after[k], before[k]) for k in after)  # the step moved the adapters

    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(results / "tp2.merged.hf", dtype=torch.float32)
    assert_logprobs(results / "tp2.after.safetensors", merged, batches)
    base = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32).eval()
    assert_logprobs(results / "tp2.reference.safetensors", base, batches)  # LoRA's reference: the base itself


@pytest.mark.parametrize("case", ["tp2", "pp2", "dp2"])
def test_adapter_gradients_equal_peft(setup, results, case):
    expected = reference_gradients(setup, micro_batches(1, 101))
    got = load_file(results / f"{case}.grads.safetensors")
    assert sorted(got) == sorted(expected)
    # the global norm counts each adapter once: a shared A once, a TP-replicated tensor once (not per rank)
    unique = [g for n, g in expected.items() if not any(f".{s}.lora_A" in n for s in SHARED)]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in unique)).item()
    assert json.loads((results / f"{case}.facts.json").read_text())["grad_norm"] == pytest.approx(norm, rel=1e-5)
    for name in expected:
        assert expected[name].abs().sum() > 0, name  # every adapter has a gradient to compare
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_only_adapters_train_and_checkpoints_reshard(results):
    adapters = load_file(results / "tp2.store" / "v00000001" / "adapter_model.safetensors")
    unique = sum(t.numel() for n, t in adapters.items() if not any(f".{s}.lora_A" in n for s in SHARED))
    dp2 = json.loads((results / "dp2.facts.json").read_text())
    assert (dp2["optimizer_elements"], dp2["ddp_elements"]) == (unique, unique)
    tp2 = json.loads((results / "tp2.facts.json").read_text())
    assert tp2["optimizer_elements"] == tp2["ddp_elements"] < unique  # rank 0's shards
    from torch.distributed.checkpoint import FileSystemReader

    saved = list(FileSystemReader(str(results / "tp2.ckpt")).read_metadata().state_dict_metadata)
    model_keys = [k for k in saved if "optimizer" not in k and "lora_" not in k]
    assert any("lora_b" in k for k in saved) and not [k for k in model_keys if k.endswith("weight")], saved
    resumed = load_file(results / "pp2.resumed.safetensors")
    assert sorted(resumed) == sorted(adapters)
    for name in adapters:
        torch.testing.assert_close(resumed[name], adapters[name], rtol=0, atol=0)
    continued, resumed_step = load_file(results / "tp2.step2.safetensors"), load_file(results / "pp2.step2.safetensors")
    for name in adapters:
        assert not torch.equal(continued[name], adapters[name]) or "lora_B" in name and not adapters[name].any()
        torch.testing.assert_close(resumed_step[name], continued[name], rtol=1e-5, atol=1e-6)
