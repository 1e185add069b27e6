"""jsd_distill against its formula written independently in NumPy (a loop over tokens, in value and gradient), at
beta 0 (equal to on_policy_distill), 1 and in between; its key's range. The batches are test_algorithms_distill.py's."""
from __future__ import annotations

import math

import numpy as np
import pytest
from test_algorithms import torch_loss_and_grad
from test_algorithms_distill import TEACHER, distill_batch

from rft.algorithms import build_algorithm
from rft.algorithms.config import AlgorithmConfig
from rft.config import ConfigError


def jsd_reference(b, *, beta, distill_coef=1.0, reward_coef=0.0, clip_eps=0.2):
    """token_mean, no KL term, rho = exp(logp - behav): per token j (Trinity-RFT's: s - t at beta 0, t - s at 1, else
    beta (t - m) + (1 - beta) (s - m) with m = log(beta e^t + (1 - beta) e^s)), A = reward_coef A_i - distill_coef j,
    l = -min(rho A, clip(rho) A); returns (loss, d loss / d logp, mean j)."""
    logp, behav, teacher, mask = b["logp"].astype(np.float64), b["old_logprobs"], b["teacher_logprobs"], b["loss_mask"]
    n_tokens = float(b["global_tokens"])
    loss, grad, j_sum = 0.0, np.zeros_like(logp), 0.0
    for i, t in zip(*np.nonzero(mask), strict=True):
        s, te = logp[i, t], float(teacher[i, t])
        if beta == 0:
            j = s - te
        elif beta == 1:
            j = te - s
        else:
            m = math.log(beta * math.exp(te) + (1 - beta) * math.exp(s))
            j = beta * (te - m) + (1 - beta) * (s - m)
        j_sum += j
        A = reward_coef * float(b["advantages"][i]) - distill_coef * j
        rho = math.exp(logp[i, t] - behav[i, t])
        rho_clip = min(max(rho, 1 - clip_eps), 1 + clip_eps)
        if rho * A <= rho_clip * A:
            loss, grad[i, t] = loss - rho * A / n_tokens, -rho * A / n_tokens
        else:
            loss -= rho_clip * A / n_tokens
    return loss, grad, j_sum / n_tokens


@pytest.mark.parametrize("beta, options", [(0.0, {}), (0.5, {}), (0.2, dict(distill_coef=0.5, distill_reward_coef=0.7)),
                                           (1.0, {})])
def test_jsd_loss_and_gradient_match_the_formula(beta, options):
    batch = distill_batch(seed=31)
    algo = build_algorithm(AlgorithmConfig.of(name="jsd_distill", teacher_path=TEACHER, loss_agg="token_mean",
                                              jsd_beta=beta, **options))
    loss, grad, metrics = torch_loss_and_grad(algo, batch)
    ref_loss, ref_grad, mean_j = jsd_reference(batch, beta=beta, distill_coef=options.get("distill_coef", 1.0),
                                               reward_coef=options.get("distill_reward_coef", 0.0))
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert metrics["teacher_jsd"] == pytest.approx(mean_j, rel=1e-5, abs=1e-7)
    assert algo.needs.teacher == TEACHER


def test_beta_zero_is_on_policy_distill():
    batch = distill_batch(seed=32)
    jsd = torch_loss_and_grad(build_algorithm(AlgorithmConfig.of(name="jsd_distill", teacher_path=TEACHER,
                                                                 jsd_beta=0.0)), batch)
    kl = torch_loss_and_grad(build_algorithm(AlgorithmConfig.of(name="on_policy_distill", teacher_path=TEACHER)), batch)
    assert jsd[0] == pytest.approx(kl[0], rel=1e-6)
    np.testing.assert_allclose(jsd[1], kl[1], rtol=1e-6)


def test_jsd_beta_outside_zero_one_is_refused():
    with pytest.raises(ConfigError, match="jsd_beta"):
        build_algorithm(AlgorithmConfig.of(name="jsd_distill", teacher_path=TEACHER, jsd_beta=1.5))
