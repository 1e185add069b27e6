"""REINFORCE++ (Hu 2025): GRPO's loss with advantages normalised over the whole batch instead of per group.

    A_i = (r_i - mean_B(r)) / (std_B(r) + eps)      over every sample of the optimizer step (population std)
No per-group baseline, so `advantages` must see all groups of the step at once (the trainer passes them all).
Departure from the paper: its KL penalty is folded into the token rewards; here KL is the same loss term as
GRPO's (`kl_coef`, k3 estimator).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rft.algorithms.grpo import ADVANTAGE_EPS, GRPO, GRPOOptions, finite_rewards
from rft.algorithms.registry import register


@register("reinforce_pp", options=GRPOOptions)
class ReinforcePlusPlus(GRPO):
    def advantages(self, rewards_per_group: Sequence[np.ndarray]) -> list[np.ndarray]:
        groups = [finite_rewards(r, i) for i, r in enumerate(rewards_per_group)]
        batch = np.concatenate(groups) if groups else np.zeros(0)
        if len(batch) < 2:
            return [np.zeros(len(r), dtype=np.float32) for r in groups]
        mean, std = batch.mean(), batch.std()
        return [((r - mean) / (std + ADVANTAGE_EPS)).astype(np.float32) for r in groups]
