"""RLOO (REINFORCE leave-one-out, Ahmadian et al. 2024): GRPO's loss with a leave-one-out baseline.

For a group of n samples, each sample's baseline is the mean reward of the *other* n - 1 samples:
    A_i = r_i - (sum_j r_j - r_i) / (n - 1)  =  n / (n - 1) * (r_i - mean(r));   a group of one gets 0.
No division by the standard deviation. Everything else (clipping, KL, off-policy correction) is GRPO's.
"""
from __future__ import annotations

import numpy as np

from rft.algorithms.grpo import GRPO, GRPOOptions
from rft.algorithms.registry import register


@register("rloo", options=GRPOOptions)
class RLOO(GRPO):
    def group_advantages(self, rewards: np.ndarray) -> np.ndarray:
        n = len(rewards)
        if n < 2:
            return np.zeros_like(rewards)
        return rewards - (rewards.sum() - rewards) / (n - 1)
