"""The teacher of on-policy distillation through the real megatron model (torchrun, 2 processes, gloo, tiny models).

- A teacher loaded from the student's own directory scores every token exactly as the student: the distillation
  step's loss, `teacher_kl` and gradient norm are 0.
- Another teacher (PP=2): its log-probs equal transformers' forward of the teacher's directory, and the step's loss,
  `teacher_kl` and gradient norm equal the unsharded computation (transformers + autograd) of the on-policy loss
  sum_t m_t (logp_t - teacher_t) / N, whose gradient is sum_t m_t sg(logp_t - teacher_t) grad logp_t / N.
- A teacher of another vocabulary size is refused, naming both directories.
"""
from __future__ import annotations

import json
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


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("teacher-models")
    return {"student": make_tiny_model(root / "student", seed=4), "other": make_tiny_model(root / "other", seed=9),
            "wide": make_tiny_model(root / "wide", vocab_size=101, seed=4)}


@pytest.fixture(scope="module")
def results(models, tmp_path_factory) -> Path:
    return run_worker_on("_worker_teacher.py", tmp_path_factory.mktemp("teacher-results"), models)


def saved(path: Path) -> list[torch.Tensor]:
    tensors = load_file(path)
    return [tensors[f"mb{i}"] for i in range(len(tensors))]


def hf_token_logprobs(model, mb) -> torch.Tensor:
    logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, mb["target_ids"][..., None])[..., 0]


def test_a_teacher_identical_to_the_student_gives_zero_loss_and_gradient(results):
    students, teachers = saved(results / "same.student.safetensors"), saved(results / "same.teacher.safetensors")
    for student, teacher in zip(students, teachers, strict=True):
        assert torch.equal(student, teacher)
    metrics = json.loads((results / "same.metrics.json").read_text())
    assert metrics["loss"] == 0.0 and metrics["teacher_kl"] == 0.0 and metrics["grad_norm"] == 0.0


def test_another_teacher_matches_the_unsharded_computation(results, models):
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(models["student"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(models["other"], dtype=torch.float32).eval()
    batches = cases.micro_batches(seed=1, vocab_size=student.config.vocab_size)
    scored = saved(results / "other.teacher.safetensors")
    loss = 0.0
    for mb, megatron_teacher in zip(batches, scored, strict=True):
        with torch.no_grad():
            expected_teacher = hf_token_logprobs(teacher, mb)
        mask = mb["loss_mask"] > 0
        np.testing.assert_allclose(megatron_teacher[mask].numpy(), expected_teacher[mask].numpy(), atol=1e-5)
        logp = hf_token_logprobs(student, mb)
        gap = (logp.detach() - expected_teacher) * mb["loss_mask"]
        assert gap.abs().sum() > 1.0, "the teacher must differ from the student"
        part = (gap * logp).sum() / mb["global_tokens"]  # gradient sum_t sg(k_t) grad logp_t / N
        part.backward()
        loss += float(gap.sum() / mb["global_tokens"])  # value at rho = 1: sum_t k_t / N
    grads = [p.grad for p in student.parameters() if p.grad is not None]
    grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    metrics = json.loads((results / "other.metrics.json").read_text())
    assert metrics["loss"] == pytest.approx(loss, rel=1e-4)
    assert metrics["teacher_kl"] == pytest.approx(loss, rel=1e-4)
    assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-3)


def test_a_teacher_of_another_vocabulary_is_refused_naming_both(results, models):
    message = (results / "wide.error.txt").read_text()
    assert f"the teacher {models['wide']} has vocab_size 101 and the student {models['student']} has 99" in message
