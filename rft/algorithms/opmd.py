"""OPMD (Online Policy Mirror Descent; Kimi k1.5, and Trinity-RFT's group-relative REINFORCE study): a group baseline
without std normalisation, and a REINFORCE loss scaled by the mirror-descent regulariser's 1 / (1 + tau).

    b     = mean(r)                                       opmd_baseline: mean (the default)
    b     = tau * log( mean_j exp(r_j / tau) )            opmd_baseline: logavgexp (the soft-max baseline of the
                                                          KL-regularised objective; tau -> 0: max, tau -> inf: mean)
    A_i   = r_i - b                                       a group of one: b = 0, so A = r (as Trinity-RFT)
    l_t   = -w_t * A_i * logp_t / (1 + tau)  +  kl_coef * k3_t
tau is `opmd_tau` (1.0) in both places, reduced by `algorithm.loss_agg` (token_mean, as Trinity-RFT). There is no
ratio and no clip (the loss is the policy gradient at the current policy; `clip_eps*` and `std_normalize` are not
used); w is GRPO's behaviour weight (1 without `off_policy_correction`). Trinity-RFT pairs it with a k2 KL loss to the
reference; here the KL is GRPO's k3 term, off unless `kl_coef` > 0. AsymRE (rft/algorithms/asymre.py) is this loss
with a shifted baseline. Use it for off-policy REINFORCE-style training where a clip would cut stale samples off.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from rft.algorithms.grpo import GRPO, GRPOOptions
from rft.algorithms.registry import Metrics, MicroBatch, register
from rft.config import POSITIVE, option
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")


@dataclass(frozen=True)
class OPMDOptions(GRPOOptions):
    """GRPO's keys (KL, aggregation, correction; the clip keys and std_normalize are not used) and OPMD's."""
    opmd_tau: float = option(1.0, range=POSITIVE,
        help="the regulariser's temperature: the loss is divided by 1 + opmd_tau, and the logavgexp baseline's tau")
    opmd_baseline: Literal["mean", "logavgexp"] = option("mean",
        help="the group baseline: mean of the rewards, or opmd_tau * log(mean(exp(r / opmd_tau)))")


@register("opmd", options=OPMDOptions)
class OPMD(GRPO):
    cfg: OPMDOptions

    def group_advantages(self, rewards: np.ndarray) -> np.ndarray:
        return rewards - self.baseline(rewards)

    def baseline(self, rewards: np.ndarray) -> float:
        """b of the module docstring (0 for a group of one)."""
        if len(rewards) < 2:
            return 0.0
        if self.cfg.opmd_baseline == "mean":
            return float(rewards.mean())
        tau = self.cfg.opmd_tau
        top = float(rewards.max())  # log-sum-exp, shifted by the maximum so large rewards cannot overflow
        return top + tau * math.log(float(np.mean(np.exp((rewards - top) / tau))))

    def policy_loss(self, logp: torch.Tensor, micro_batch: MicroBatch, prox: torch.Tensor,
                    weight: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        advantage = micro_batch["advantages"].float()[:, None]
        return -weight.detach() * advantage * logp / (1.0 + self.cfg.opmd_tau), {}
