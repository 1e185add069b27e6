"""REINFORCE (Williams 1992): the raw reward as every token's advantage, no baseline, GRPO's loss.

    A_i = r_i
    l_t = -w_t * min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i) + kl_coef * k3_t
On fresh samples (rho = 1) the gradient is the vanilla policy gradient -r_i grad logp_t; the clip, the KL term, the
aggregation and the off-policy correction are GRPO's (rft/algorithms/grpo.py). Trinity-RFT's `reinforce` advantage
(which its TOPR uses); `std_normalize` does not apply. Use it with rewards that are already centred (e.g. +1 / -1),
as a baseline to compare others against, or as the advantage of TOPR (rft/algorithms/topr.py).
"""
from __future__ import annotations

import numpy as np

from rft.algorithms.grpo import GRPO, GRPOOptions
from rft.algorithms.registry import register


@register("reinforce", options=GRPOOptions)
class REINFORCE(GRPO):
    def group_advantages(self, rewards: np.ndarray) -> np.ndarray:
        return rewards.copy()
