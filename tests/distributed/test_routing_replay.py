"""Routing replay shrinks the training-inference mismatch of a tiny random Qwen3-MoE (8 experts, top-2) at expert
parallelism 2, and the same at tensor parallelism 2 (sequence parallel: each TP rank routes its slice).

Rollouts are recorded by the transformers engine with their routing, twice: in bfloat16 (the honest source of
mismatch production has: an inference engine in bf16, the trainer in float32; bf16 rounding flips the routers' close
calls, and a token sent to other experts gets another distribution) and in float32 (the same numerics as the
trainer: with replay, what is left is float32 noise). The trainer (megatron, float32, EP 2 under torchrun/gloo)
scores the same recorded micro-batches with the recorded routing replayed and routed by itself; its train_step logs
the same mismatch it measured with replay. The model's weights are scaled x4 (`sharpen`) so that routing matters as
much as in a trained model. Measured (seed 3): bf16 mismatch mean 0.0168 -> 0.0076 with replay, max 0.61 -> 0.031;
f32: 4e-7 either way. The same to three digits since routing is recorded from the last prompt position (the default,
run.routing_prefill false: the trainer routes the prompt's other positions itself) instead of from the first.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from rft.engine import SamplingSettings, TransformersEngine
from rft.models.tiny import make_tiny_model
from rft.schema import ExperienceGroup, Sample, encode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import HERE, assert_succeeded, torchrun  # noqa: E402

pytestmark = pytest.mark.distributed
PROMPTS = ["12+7=", "hello world", "the cat sat on", "9*9=", "abc", "Q: why? A:"]


def record(model_dir: Path, dtype: str, out: Path) -> Path:
    """Rollouts of PROMPTS (4 samples each, 24 tokens, temperature 1) with their routing, as experience-group
    records."""
    engine = TransformersEngine(model_dir, dtype=dtype, record_routing=True, seed=7)
    values = []
    for task, prompt in enumerate(PROMPTS):
        generation = engine.generate([engine.encode(prompt)], SamplingSettings(n=4, max_tokens=24))[0]
        samples = [Sample(sample_index=j, prompt_tokens=np.asarray(generation.prompt_token_ids, np.int32),
                          response_tokens=np.asarray(c.token_ids, np.int32),
                          logprobs=np.asarray(c.logprobs, np.float32), loss_mask=np.ones(len(c.token_ids), np.uint8),
                          reward=0.0, routed_experts=c.routed_experts)
                   for j, c in enumerate(generation.completions)]
        values.append(encode(ExperienceGroup(run_id="r", task_id=str(task), group_id=f"r/{task}/e0", attempt=0,
                                             explorer_id="test", policy_version=0, samples=samples))[0])
    out.write_bytes(msgpack.packb(values, use_bin_type=True))
    return out


def sharpen(model_dir: Path, factor: float = 4.0) -> Path:
    """Every weight but the norms' times `factor`, in place. At the tiny model's random initialisation (std 0.02) the
    experts add so little to the residual stream, and the logits are so flat, that the choice of experts hardly
    moves a log-prob; x4 makes the model about as decisive as a trained one (peaked next-token distributions)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    save_file({k: v if "norm" in k else v * factor for k, v in tensors.items()}, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("routing-replay")
    moe = sharpen(make_tiny_model(root / "moe", arch="qwen3_moe", experts=8, experts_per_token=2, seed=3))
    records = {dtype: str(record(moe, dtype, root / f"{dtype}.records")) for dtype in ("bfloat16", "float32")}
    out = root / "out"
    out.mkdir()
    spec = {"out_dir": str(out), "moe": str(moe), "records": records, "train_on": "float32"}
    (out / "spec.json").write_text(json.dumps(spec))
    assert_succeeded(torchrun([str(HERE / "_worker_routing_replay.py"), str(out / "spec.json")], timeout=400))
    return {name: json.loads((out / f"{name}.ep2.json").read_text()) for name in records} | {
        f"{name}.tp2": json.loads((out / f"{name}.tp2.json").read_text()) for name in records}


def test_replay_shrinks_the_mismatch_of_bf16_rollouts(results):
    bf16 = results["bfloat16"]
    print("bf16 rollouts:", json.dumps(bf16))
    assert bf16["replayed_fraction"] == 1.0
    assert bf16["replay"]["mean"] < 0.7 * bf16["no_replay"]["mean"]
    assert bf16["replay"]["max"] < 0.5 * bf16["no_replay"]["max"]


def test_with_the_trainers_numerics_routing_agrees_and_replay_changes_nothing(results):
    f32 = results["float32"]
    print("f32 rollouts:", json.dumps(f32))
    assert f32["replay"]["max"] < 1e-4 and f32["no_replay"]["max"] < 1e-4
    assert f32["replay"]["mean"] == pytest.approx(f32["no_replay"]["mean"], rel=1e-3)


def test_train_step_logs_the_mismatch_it_trained_with(results):
    f32 = results["float32"]
    assert f32["train_step"]["mean"] == pytest.approx(f32["replay"]["mean"], rel=1e-3, abs=1e-7)
    assert f32["train_step"]["max"] == pytest.approx(f32["replay"]["max"], rel=1e-3, abs=1e-7)


def test_tensor_and_sequence_parallel_routers_replay_the_same_routing(results):
    for name in ("bfloat16", "float32"):
        for how in ("replay", "no_replay"):
            # float32 reductions in another order: a few 1e-6 apart at most
            assert results[f"{name}.tp2"][how]["mean"] == pytest.approx(results[name][how]["mean"], rel=1e-3, abs=1e-5)
            assert results[f"{name}.tp2"][how]["max"] == pytest.approx(results[name][how]["max"], rel=1e-3, abs=1e-5)
