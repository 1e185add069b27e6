"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): GRPO's advantages with a sequence-level ratio.

For sample i with |y_i| loss tokens the ratio is the length-normalised sequence likelihood ratio
    s_i = (pi_theta(y_i) / pi_prox(y_i)) ^ (1 / |y_i|) = exp( sum_t m_it (logp_it - prox_it) / |y_i| )
    l_i  = -w_i * min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)
    loss = sum_i l_i / global_sequences     (+ kl_coef * the k3 KL term per sequence mean, as GRPO's seq_mean)
so a sample is clipped whole. `loss_agg` does not apply (the objective is per sequence, which every micro-batch and
DP partition reproduces exactly: a row is always a whole sample). Default clip range eps_low = 3e-4, eps_high =
4e-4 (the paper's); `algorithm.clip_eps` is not used.

prox and w, GRPO's roles (rft/algorithms/grpo.py) at the sequence level:
- `off_policy_correction: false` (the paper): prox = the behaviour policy (`old_logprobs`), w_i = 1.
- `off_policy_correction: true` (rft's extension): prox = the policy the step starts from, and w_i =
  min((pi_prox(y_i) / pi_behav(y_i)) ^ (1 / |y_i|), importance_cap), a constant, usable on recorded experiences of
  any age (`supports_replay`); `mis` and `sequence_mask` apply to the same ratio (correction.py, `level="sequence"`).
Metrics: `clip_frac` (fraction of sequences clipped), `seq_ratio_mean` (mean s_i); `importance_weight_mean` /
`importance_weight_truncated_frac` over loss tokens of their samples' w_i.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rft.algorithms.correction import sequence_mean
from rft.algorithms.grpo import GRPO, GRPOOptions
from rft.algorithms.registry import Metrics, MicroBatch, register
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")


@register("gspo", options=GRPOOptions)
class GSPO(GRPO):
    default_clip = (3e-4, 4e-4)
    correction_level = "sequence"  # w_i: the sample's length-normalised behaviour weight (rft/algorithms/correction.py)

    def __init__(self, options: GRPOOptions):
        super().__init__(options)
        self.loss_agg = "seq_mean"  # l_i is the same on every token of sample i: seq_mean sums l_i / S

    def policy_loss(self, logp: torch.Tensor, micro_batch: MicroBatch, prox: torch.Tensor,
                    weight: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        """`weight` is w_i on every loss token of sample i (0 elsewhere), so its row maximum is w_i."""
        mask = micro_batch["loss_mask"] > 0
        advantage = micro_batch["advantages"].float()
        ratio = torch.exp(sequence_mean(logp - prox, mask))
        clipped = ratio.clamp(1 - self.clip_low, 1 + self.clip_high)
        per_sequence = -weight.amax(-1) * torch.minimum(ratio * advantage, clipped * advantage)
        real = (mask.sum(-1) > 0).float()  # a row without loss tokens is padding: no sequence
        sequences = micro_batch["global_sequences"].clamp(min=1)
        metrics = {"clip_frac": ((clipped * advantage < ratio * advantage).float() * real).sum() / sequences,
                   "seq_ratio_mean": (ratio.detach() * real).sum() / sequences}
        return per_sequence[:, None].expand_as(logp), metrics

