"""on_policy_distill and chord against textbook formulas written independently in NumPy (loops over samples and
tokens), in value and gradient, and for invariance under micro-batch and data-parallel splits; chord's schedule
against its closed form. The batches and split helpers are test_algorithms.py's."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_algorithms import assert_split_changes_nothing, random_batch, torch_loss_and_grad

from rft.algorithms import build_algorithm
from rft.algorithms.aggregation import with_kl_metric
from rft.algorithms.chord import sft_weight
from rft.algorithms.config import AlgorithmConfig
from rft.config import ConfigError


def distill_batch(seed: int, *, rows: int = 7, stale: float = 0.3, teacher_gap: float = 0.8) -> dict[str, np.ndarray]:
    batch = random_batch(seed, rows=rows, stale=stale)
    rng = np.random.default_rng(seed + 50)
    batch["teacher_logprobs"] = ((batch["logp"] + rng.normal(0, teacher_gap, batch["logp"].shape))
                                 * batch["loss_mask"]).astype(np.float32)
    return batch


def distill_reference(b, *, agg, distill_coef=1.0, reward_coef=0.0, clip_eps=0.2, kl_coef=0.0, correction=False,
                      cap=np.inf):
    """Per token: k = logp - teacher (a constant), A = reward_coef * A_i - distill_coef * k, rho = exp(logp - p)
    with p = behav (w = 1) or, with `correction`, p = logp and w = min(exp(logp - behav), cap);
    l = -w * min(rho A, clip(rho) A) + kl_coef * k3; returns (loss, d loss / d logp, mean k over tokens)."""
    logp, behav, teacher, mask = b["logp"].astype(np.float64), b["old_logprobs"], b["teacher_logprobs"], b["loss_mask"]
    n_tokens, n_seqs = float(b["global_tokens"]), float(b["global_sequences"])
    loss, grad, k_sum = 0.0, np.zeros_like(logp), 0.0
    for i in range(logp.shape[0]):
        length = mask[i].sum()
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            scale = 1.0 / n_tokens if agg == "token_mean" else 1.0 / (length * n_seqs)
            k = logp[i, t] - teacher[i, t]
            k_sum += k
            A = reward_coef * float(b["advantages"][i]) - distill_coef * k
            p, w = (logp[i, t], min(math.exp(logp[i, t] - behav[i, t]), cap)) if correction else (behav[i, t], 1.0)
            rho = math.exp(logp[i, t] - p)
            rho_clip = min(max(rho, 1 - clip_eps), 1 + clip_eps)
            if rho * A <= rho_clip * A:
                value, d_value = -w * rho * A, -w * rho * A
            else:
                value, d_value = -w * rho_clip * A, 0.0
            delta = b["ref_logprobs"][i, t] - logp[i, t]
            loss += scale * (value + kl_coef * (math.exp(delta) - delta - 1))
            grad[i, t] = scale * (d_value + kl_coef * (1 - math.exp(delta)))
    return loss, grad, k_sum / n_tokens


TEACHER = "/models/teacher"


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("options", [dict(), dict(distill_coef=0.5, distill_reward_coef=0.7, kl_coef=0.1)])
def test_distill_loss_and_gradient_match_textbook(agg, options):
    batch = distill_batch(seed=21)
    algo = build_algorithm(AlgorithmConfig.of(name="on_policy_distill", teacher_path=TEACHER, loss_agg=agg, **options))
    loss, grad, metrics = torch_loss_and_grad(algo, batch)
    ref_loss, ref_grad, teacher_kl = distill_reference(
        batch, agg=agg, distill_coef=options.get("distill_coef", 1.0),
        reward_coef=options.get("distill_reward_coef", 0.0), kl_coef=options.get("kl_coef", 0.0))
    assert metrics["clip_frac"] > 0.05, "the batch must exercise clipping"
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert metrics["teacher_kl"] == pytest.approx(teacher_kl, rel=1e-5)
    assert algo.needs.teacher == TEACHER and not algo.supports_replay


def test_distill_with_off_policy_correction_matches_textbook():
    batch = distill_batch(seed=22, stale=1.0)
    algo = build_algorithm(AlgorithmConfig.of(name="on_policy_distill", teacher_path=TEACHER,
                                              off_policy_correction=True, importance_cap=2.0))
    loss, grad, metrics = torch_loss_and_grad(algo, batch)
    ref_loss, ref_grad, _ = distill_reference(batch, agg="token_mean", correction=True, cap=2.0)
    assert metrics["importance_weight_truncated_frac"] > 0.05
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert algo.supports_replay


def test_distill_toward_an_identical_teacher_is_zero_and_rewards_do_not_enter():
    """teacher == student: k = 0, so with distill_reward_coef 0 the loss and gradient vanish whatever the rewards."""
    batch = distill_batch(seed=23)
    batch["teacher_logprobs"] = batch["logp"] * batch["loss_mask"]
    loss, grad, metrics = torch_loss_and_grad(
        build_algorithm(AlgorithmConfig.of(name="on_policy_distill", teacher_path=TEACHER)), batch)
    assert loss == 0.0 and not grad.any() and metrics["teacher_kl"] == 0.0


def test_distill_gradient_is_the_reverse_kl_gradient():
    """Exact expectation over a categorical student: with rho = 1 the expected gradient w.r.t. the student's logits
    of the per-token loss equals the analytic gradient of KL(student || teacher) (token_mean over one token)."""
    student_logits = torch.tensor([0.3, -1.0, 0.8, 0.1], dtype=torch.float64, requires_grad=True)
    teacher = np.log(np.array([0.1, 0.2, 0.3, 0.4]))
    algo = build_algorithm(AlgorithmConfig.of(name="on_policy_distill", teacher_path=TEACHER))
    student = torch.log_softmax(student_logits, -1)
    expected = 0.0
    for y in range(4):  # E_{y ~ student}[loss(y)] by exact enumeration; the sampling weight is a constant
        logp = student[y].reshape(1, 1)
        micro = {"loss_mask": torch.ones(1, 1), "old_logprobs": logp.detach().float(),
                 "teacher_logprobs": torch.tensor([[teacher[y]]]), "advantages": torch.zeros(1),
                 "global_tokens": torch.tensor(1.0), "global_sequences": torch.tensor(1.0)}
        loss, _ = algo.loss_fn(logp, micro)
        expected = expected + student[y].exp().detach() * loss
    grad = torch.autograd.grad(expected, student_logits)[0].numpy()
    p = np.exp(student.detach().numpy())
    kl_terms = np.log(p) - teacher
    analytic = p * (kl_terms - np.sum(p * kl_terms))  # d/dz KL(softmax(z) || q)
    np.testing.assert_allclose(grad, analytic, rtol=1e-5, atol=1e-7)


def test_distill_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="algorithm.teacher_path: on_policy_distill needs"):
        build_algorithm(AlgorithmConfig.of(name="on_policy_distill"))
    with pytest.raises(ConfigError, match="algorithm.distill_coef: must be >= 0, got -1"):
        build_algorithm(AlgorithmConfig.of(name="on_policy_distill", teacher_path=TEACHER, distill_coef=-1.0))
    with pytest.raises(ConfigError, match="algorithm.distill_coef: with distill_reward_coef also 0"):
        build_algorithm(AlgorithmConfig.of(name="on_policy_distill", teacher_path=TEACHER, distill_coef=0.0))
    batch = distill_batch(seed=24)
    del batch["teacher_logprobs"]
    logp = torch.tensor(batch.pop("logp"))
    with pytest.raises(ValueError, match="on_policy_distill loss: micro-batch lacks teacher_logprobs"):
        build_algorithm(AlgorithmConfig.of(name="on_policy_distill", teacher_path=TEACHER)).loss_fn(
            logp, {k: torch.as_tensor(v) for k, v in batch.items()})


def test_a_teacher_of_another_vocabulary_is_a_config_error_naming_both(tiny_model, tmp_path):
    from rft.models.tiny import make_tiny_model
    from rft.run.loading import run_config_from_dict

    wide = make_tiny_model(tmp_path / "wide", vocab_size=101)
    raw = {"model": {"path": str(tiny_model)}, "algorithm": {"name": "on_policy_distill", "teacher_path": str(wide)}}
    with pytest.raises(ConfigError, match=f"cfg.yaml: algorithm.teacher_path: the teacher {wide} has vocab_size "
                                          f"101 and the student {tiny_model} has 99"):
        run_config_from_dict(raw, "cfg.yaml")
    raw["algorithm"]["teacher_path"] = str(tiny_model)
    assert run_config_from_dict(raw, "cfg.yaml").algorithm.options["teacher_path"] == str(tiny_model)


# -------------------------------------------------------------------------------------------------------- chord

def chord_batch(seed: int, *, rows: int = 12) -> dict[str, np.ndarray]:
    """Every third row a demonstration (behaviour log-probs 0, as rft/data/demonstrations.py records them)."""
    batch = random_batch(seed, rows=rows, stale=0.4)
    demo = (np.arange(rows) % 3 == 0).astype(np.float32)
    batch["old_logprobs"] = (batch["old_logprobs"] * (1 - demo[:, None])).astype(np.float32)
    batch["demo_mask"] = demo
    batch["global_demo_tokens"] = np.float32((batch["loss_mask"] * demo[:, None]).sum())
    batch["global_demo_sequences"] = np.float32(demo[:-1].sum())  # the last row is padding (random_batch)
    batch["step"] = np.float32(3)
    return batch


def chord_reference(b, *, agg, mu, clip_eps=0.2):
    """(1 - mu) * [clipped surrogate over policy rows, normalised by their tokens / sequences]
    + mu * [NLL over demonstration rows, normalised by theirs]; and d/d logp."""
    logp, behav, mask, demo = b["logp"].astype(np.float64), b["old_logprobs"], b["loss_mask"], b["demo_mask"]
    counts = {True: (float(b["global_demo_tokens"]), float(b["global_demo_sequences"])),
              False: (float(b["global_tokens"] - b["global_demo_tokens"]),
                      float(b["global_sequences"] - b["global_demo_sequences"]))}
    loss, grad = 0.0, np.zeros_like(logp)
    for i in range(logp.shape[0]):
        is_demo = bool(demo[i])
        n_tokens, n_seqs = counts[is_demo]
        length = mask[i].sum()
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            scale = 1.0 / n_tokens if agg == "token_mean" else 1.0 / (length * n_seqs)
            if is_demo:
                loss += mu * scale * -logp[i, t]
                grad[i, t] = -mu * scale
                continue
            A = float(b["advantages"][i])
            rho = math.exp(logp[i, t] - behav[i, t])
            rho_clip = min(max(rho, 1 - clip_eps), 1 + clip_eps)
            value, d_value = (-rho * A, -rho * A) if rho * A <= rho_clip * A else (-rho_clip * A, 0.0)
            loss += (1 - mu) * scale * value
            grad[i, t] = (1 - mu) * scale * d_value
    return loss, grad


CHORD = dict(chord_mu_start=0.9, chord_mu_end=0.1, chord_mu_steps=4)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_chord_loss_and_gradient_match_textbook(agg, schedule):
    batch = chord_batch(seed=31)
    algo = build_algorithm(AlgorithmConfig.of(name="chord", loss_agg=agg, chord_mu_schedule=schedule, **CHORD))
    mu = {"linear": 0.5, "cosine": 0.5}[schedule]  # step 3 of 4: halfway for both shapes
    loss, grad, metrics = torch_loss_and_grad(algo, batch)
    ref_loss, ref_grad = chord_reference(batch, agg=agg, mu=mu)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert metrics["sft_loss"] == pytest.approx(chord_reference(batch, agg=agg, mu=1.0)[0], rel=1e-5)
    assert metrics["rl_loss"] == pytest.approx(chord_reference(batch, agg=agg, mu=0.0)[0], rel=1e-5)
    demo = batch["demo_mask"] > 0
    assert np.all(grad[demo][batch["loss_mask"][demo] > 0] < 0), "demonstration tokens are pushed up by SFT only"


def test_chord_kl_metric_ignores_demonstrations():
    """Demonstrations have no behaviour policy: the behaviour k3 is over the policy rows (and their token count)."""
    batch = chord_batch(seed=32)
    logp, micro = torch.tensor(batch["logp"]), {k: torch.as_tensor(v) for k, v in batch.items() if k != "logp"}
    _, metrics = with_kl_metric(build_algorithm(AlgorithmConfig.of(name="chord", **CHORD)).loss_fn)(logp, micro)
    policy = (batch["loss_mask"] > 0) & (batch["demo_mask"][:, None] == 0)
    x = (batch["logp"] - batch["old_logprobs"])[policy].astype(np.float64)
    expected = np.sum(np.exp(x) - x - 1) / policy.sum()
    assert metrics["kl"].item() == pytest.approx(expected, rel=1e-5)


def schedule_reference(step, *, start, end, steps, shape):
    if steps == 0 or step - 1 >= steps:
        return end
    p = (step - 1) / steps
    return start + (end - start) * p if shape == "linear" else end + (start - end) * 0.5 * (1 + np.cos(np.pi * p))


@pytest.mark.parametrize("shape", ["linear", "cosine"])
def test_chord_schedule(shape):
    expected = {"linear": [0.9, 0.7, 0.5, 0.3, 0.1, 0.1], "cosine": [0.9, 0.1 + 0.8 * (1 + math.sqrt(0.5)) / 2,
                                                                     0.5, 0.1 + 0.8 * (1 - math.sqrt(0.5)) / 2,
                                                                     0.1, 0.1]}[shape]
    got = [sft_weight(s, start=0.9, end=0.1, steps=4, schedule=shape) for s in (1, 2, 3, 4, 5, 40)]
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    for s in range(1, 30):
        assert sft_weight(s, start=0.2, end=0.8, steps=17, schedule=shape) == pytest.approx(
            schedule_reference(s, start=0.2, end=0.8, steps=17, shape=shape), rel=1e-12)
    assert sft_weight(1, start=0.9, end=0.3, steps=0, schedule=shape) == pytest.approx(0.3, rel=1e-12)


def test_chord_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"algorithm.chord_mu_start: must be in \[0, 1\]"):
        build_algorithm(AlgorithmConfig.of(name="chord", chord_mu_start=1.5))
    with pytest.raises(ConfigError, match="algorithm.chord_mu_steps: must be >= 0"):
        build_algorithm(AlgorithmConfig.of(name="chord", chord_mu_steps=-1))
    batch = chord_batch(seed=33)
    del batch["step"]
    logp = torch.tensor(batch.pop("logp"))
    with pytest.raises(ValueError, match="chord loss: micro-batch lacks step"):
        build_algorithm(AlgorithmConfig.of(name="chord")).loss_fn(logp,
                                                                  {k: torch.as_tensor(v) for k, v in batch.items()})


# ----------------------------------------------------------------------------- micro-batch and data-parallel splits

@pytest.mark.parametrize("name, options", [
    ("on_policy_distill", dict(teacher_path=TEACHER, distill_reward_coef=0.5, kl_coef=0.1)),
    ("on_policy_distill", dict(teacher_path=TEACHER, loss_agg="seq_mean", off_policy_correction=True)),
    ("chord", dict(CHORD, loss_agg="token_mean", kl_coef=0.1)),
    ("chord", dict(CHORD, loss_agg="seq_mean", chord_mu_schedule="linear")),
])
def test_splitting_into_micro_batches_and_shards_changes_nothing(name, options):
    batch = distill_batch(seed=34, rows=12) if name == "on_policy_distill" else chord_batch(seed=34)
    assert_split_changes_nothing(build_algorithm(AlgorithmConfig.of(name=name, **options)), batch)
