"""float16 training with megatron's dynamic loss scaler (one process, gloo, the tiny model).

Before `grad_scale_func` was set, megatron's schedule never multiplied the loss by the scale while the optimizer
still divided the gradients by it (2^32 by default): float16 gradients came out ~2^-32 of the true ones. Here:
- the scale follows the DynamicGradScaler rule step by step (simulated below from its documented contract);
- overflowing steps are skipped and leave the weights unchanged;
- the first clean step's gradient norm equals the unsharded float32 gradient norm (transformers, same weights
  rounded to float16, same loss) within float16 accuracy.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rft.models.tiny import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _worker_policy as cases  # noqa: E402
from _launch import HERE, REPO  # noqa: E402

pytestmark = pytest.mark.distributed
INITIAL_SCALE, STEPS = 2.0 ** 24, 14


def expected_scales(found_inf: list[bool], initial: float, hysteresis: int = 2, window: int = 1000) -> list[float]:
    """The scale before each step: halve on an overflow once `hysteresis` overflows have been seen since the last
    growth, double after `window` clean steps in a row (megatron.core.optimizer.grad_scaler.DynamicGradScaler)."""
    scale, growth, hysteresis_left, scales = initial, 0, hysteresis, []
    for overflow in found_inf:
        scales.append(scale)
        if overflow:
            growth, hysteresis_left = 0, hysteresis_left - 1
            if hysteresis_left <= 0:
                scale = max(scale * 0.5, 1.0)
        else:
            growth += 1
            if growth == window:
                growth, hysteresis_left, scale = 0, hysteresis, scale * 2
    return scales


def reference_grad_norm(hf_dir: Path) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())  # the float16 policy's weights
    batch = cases.micro_batches(seed=1, vocab_size=model.config.vocab_size)
    for mb in batch:
        logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits.float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, mb["target_ids"][..., None])[..., 0]
        cases.token_mean_nll(logprobs, mb)[0].backward()
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)))


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("fp16")
    hf_dir = make_tiny_model(root / "tiny", arch="qwen2", vocab_size=101, seed=4)
    out = root / "steps.json"
    result = subprocess.run([sys.executable, str(HERE / "_worker_fp16.py"), str(hf_dir), str(out), str(INITIAL_SCALE),
                             str(STEPS)], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                          "PYTHONPATH": os.pathsep.join(filter(None, [
                                                              str(REPO), os.environ.get("PYTHONPATH")]))},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-6000:]
    return hf_dir, json.loads(out.read_text())


def test_the_scale_backs_off_by_the_scalers_rule_and_overflowing_steps_change_nothing(steps):
    _, records = steps
    overflow = [r["skipped"] == 1.0 for r in records]
    assert overflow[0], "2^24 times the loss must overflow float16 gradients"
    assert not overflow[-1], f"the scale never came down far enough: {records}"
    assert [r["scale"] for r in records] == expected_scales(overflow, INITIAL_SCALE)
    before = None
    for r in records:
        if r["skipped"] == 1.0 and before is not None:
            assert r["main_weights_abs_sum"] == before, "a skipped step changed the weights"
        before = r["main_weights_abs_sum"]


def test_the_first_clean_steps_gradient_is_the_unscaled_float32_gradient(steps):
    hf_dir, records = steps
    clean = next(r for r in records if r["skipped"] == 0.0)
    expected = reference_grad_norm(hf_dir)
    assert clean["grad_norm"] == pytest.approx(expected, rel=0.02), (clean, expected)
