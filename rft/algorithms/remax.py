"""ReMax (Li et al. 2023, arXiv:2310.10505): the reward minus the reward of the task's greedy response, GRPO's loss.

    A_i = r_i - r_greedy
    l_t = -w_t * min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i) + kl_coef * k3_t
r_greedy is the reward of one greedy (temperature 0) response to the task, which the explorer generates and scores
beside the group's n samples (`explorer.greedy_baseline`, on with this algorithm) and records as the group's
`greedy_reward`; the greedy response is not trained on. A group without one is dead-lettered by the trainer's check
(`Needs.greedy_baseline`). No normalisation; `std_normalize` does not apply. The clip, the KL term, the aggregation
and the off-policy correction are GRPO's (rft/algorithms/grpo.py). Trinity-RFT's `remax` advantage (verl's).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from rft.algorithms.grpo import GRPO, GRPOOptions, finite_rewards
from rft.algorithms.registry import register


@register("remax", options=GRPOOptions)
class ReMax(GRPO):
    def __init__(self, options: GRPOOptions):
        super().__init__(options)
        self.needs = dataclasses.replace(self.needs, greedy_baseline=True)

    def advantages(self, rewards_per_group: Sequence[np.ndarray]) -> list[np.ndarray]:
        raise ValueError("remax: advantages need each group's greedy reward: call baseline_advantages")

    def baseline_advantages(self, rewards_per_group: Sequence[np.ndarray],
                            baselines: Sequence[float]) -> list[np.ndarray]:
        if len(baselines) != len(rewards_per_group):
            raise ValueError(f"remax: {len(baselines)} greedy rewards for {len(rewards_per_group)} groups")
        out = []
        for i, (rewards, baseline) in enumerate(zip(rewards_per_group, baselines, strict=True)):
            if not np.isfinite(baseline):
                raise ValueError(f"advantages: group {i} has a non-finite greedy reward {baseline!r}")
            out.append((finite_rewards(rewards, i) - float(baseline)).astype(np.float32))
        return out
