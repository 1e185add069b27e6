"""The pass before a step of `Needs.step_start` (MegatronPolicy.step_start) through the real megatron model (torchrun,
2 processes, gloo, the tiny model with an odd vocabulary of 101, so TP=2 pads it): at TP=2 (vocabulary-parallel
reductions) and at TP=1 (DP=2), `start_logprobs`, the per-token entropy and Clip_V's collision term
sum_v p_v^2 (log p_v + H) equal those computed here from transformers' full logits by torch's softmax, at the
explorers' temperature (0.7), at loss positions (0 elsewhere).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rft.models.tiny import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _worker_policy as cases  # noqa: E402
from _launch import run_worker_on  # noqa: E402

pytestmark = pytest.mark.distributed
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("step-start-model") / "qwen", arch="qwen2", vocab_size=101, seed=4)


@pytest.fixture(scope="module")
def results(model, tmp_path_factory) -> Path:
    return run_worker_on("_worker_step_start.py", tmp_path_factory.mktemp("step-start-results"), {"qwen": model})


def expected(model: Path) -> list[dict[str, torch.Tensor]]:
    """Per micro-batch: log-probs of the targets, entropy and collision term from the full softmax."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = []
    for mb in cases.micro_batches(1, hf.config.vocab_size):
        with torch.no_grad():
            logits = hf(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits.double() / TEMPERATURE
        logp = torch.log_softmax(logits, -1)
        p = logp.exp()
        entropy = -(p * logp).sum(-1)
        collision = (p.square() * (logp + entropy[..., None])).sum(-1)
        mask = mb["loss_mask"] > 0
        out.append({"start_logprobs": logp.gather(-1, mb["target_ids"][..., None])[..., 0], "mask": mask,
                    "start_entropy": torch.where(mask, entropy, 0.0),
                    "start_collision": torch.where(mask, collision, 0.0)})
    return out


@pytest.mark.parametrize("case, batches", [("tp2", range(cases.MICRO_BATCHES)),
                                           ("dp2", range(cases.MICRO_BATCHES // 2))])
def test_start_quantities_equal_the_full_softmax(results, model, case, batches):
    got = load_file(results / f"{case}.safetensors")
    reference = expected(model)
    for i in batches:
        mask = reference[i]["mask"]
        for key in ("start_logprobs", "start_entropy", "start_collision"):
            values = got[f"mb{i}.{key}"].double()
            want = reference[i][key]
            np.testing.assert_allclose(values[mask].numpy(), want[mask].numpy(), rtol=1e-4, atol=1e-5, err_msg=key)
            if key != "start_logprobs":
                assert not values[~mask].any(), f"{key}: nonzero outside the loss mask"
        assert reference[i]["start_collision"][mask].abs().max() > 1e-4, "the collision term must not vanish here"
