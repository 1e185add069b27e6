"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): GRPO's advantages with a sequence-level ratio.

For sample i with |y_i| loss tokens, the importance ratio is the length-normalised sequence likelihood ratio
    s_i = (pi_theta(y_i) / pi_prox(y_i)) ^ (1 / |y_i|) = exp( sum_t m_it (logp_it - prox_it) / |y_i| )
and the loss is the clipped surrogate on whole sequences, averaged over the sequences of the step:
    l_i  = -w_i * min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)
    loss = sum_i l_i / global_sequences     (+ kl_coef * the k3 KL term per sequence mean, as GRPO's seq_mean)
so a sample is clipped (all its tokens, or none) by how far its whole sequence moved. `loss_agg` does not apply: the
objective is per sequence (the paper's; verl's and Trinity-RFT's "seq-mean-token-mean"), which every partition of
the rows into micro-batches and data-parallel shards reproduces exactly (a row is always a whole sample). The
gradient of l_i is -w_i A_i s_i / |y_i| * sum_t grad logp_it where the unclipped term is the minimum, else 0 (the
paper's equation 8).

Ratios of whole sequences stay much closer to 1 than per-token ones, so the clip range is small: eps_low = 3e-4,
eps_high = 4e-4 by default (the paper's settings, as verl's recipe and Trinity-RFT); `algorithm.clip_eps` is not
used.

prox and w, as GRPO's roles (rft/algorithms/grpo.py) at the sequence level:
- `off_policy_correction: false` (the paper): prox = the behaviour policy (`old_logprobs`), w_i = 1.
- `off_policy_correction: true`: prox = the policy the step starts from (`prox_logprobs`, else `token_logprobs`
  detached: s_i = 1 in value), and w_i = min((pi_prox(y_i) / pi_behav(y_i)) ^ (1 / |y_i|), importance_cap), the
  length-normalised sequence importance weight, a constant: a truncated, sequence-level importance-weighted policy
  gradient that is usable on recorded experiences of any age (`supports_replay`). This decoupled form is rft's
  extension (GRPO's decoupled PPO at the sequence level), not in the paper. `importance_sampling: mis` and
  `sequence_mask` apply to the same sequence ratio (rft/algorithms/correction.py, `level="sequence"`).
Metrics: `clip_frac` is the fraction of sequences clipped, `seq_ratio_mean` the mean of s_i over sequences;
`importance_weight_mean` / `importance_weight_truncated_frac` are over loss tokens of the w_i of their samples.
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

