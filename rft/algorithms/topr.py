"""TOPR (Le Roux et al. 2025, "Tapered Off-Policy REINFORCE"): the raw reward, and a truncated importance weight on
the negative samples only.

    alpha_t = clip(r_t, 0, 1)  if R_i <= topr_threshold,  else 1          r_t = exp(logp_t - prox_t)
    l_t     = -w_t * sg(alpha_t) * R_i * logp_t   +  kl_coef * k3_t
R_i is the sample's reward (REINFORCE's advantage, rft/algorithms/reinforce.py: no baseline), sg stop-gradient:
positive samples get the plain SFT-like gradient -R grad logp, negative ones a weight that tapers as the policy
moves away from the behaviour policy, so pushing down a sample the policy no longer makes stops. Reduced by
`algorithm.loss_agg` (Trinity-RFT: a token mean, the default here). prox and w are GRPO's (behaviour policy and 1
without `off_policy_correction`). Defaults as Trinity-RFT: topr_threshold 0.0. Metrics: `topr_alpha_mean`,
`topr_negative_frac` (tokens of samples at or below the threshold).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rft.algorithms.aggregation import token_metric
from rft.algorithms.grpo import GRPOOptions, token_ratio
from rft.algorithms.registry import Metrics, MicroBatch, register
from rft.algorithms.reinforce import REINFORCE
from rft.config import FINITE, option
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")


@dataclass(frozen=True)
class TOPROptions(GRPOOptions):
    """GRPO's keys (KL, aggregation, correction; the clip keys are not used) and TOPR's threshold."""
    topr_threshold: float = option(0.0, range=FINITE,
        help="samples with reward <= topr_threshold are negatives: their weight is clip(ratio, 0, 1)")


@register("topr", options=TOPROptions)
class TOPR(REINFORCE):
    cfg: TOPROptions

    def policy_loss(self, logp: torch.Tensor, micro_batch: MicroBatch, prox: torch.Tensor,
                    weight: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        reward = micro_batch["advantages"].float()[:, None]
        negative = (reward <= self.cfg.topr_threshold).expand_as(logp)
        alpha = torch.where(negative, token_ratio(logp.detach(), prox, micro_batch).clamp(0, 1), 1.0)
        per_token = -(weight * alpha).detach() * reward * logp
        return per_token, {"topr_alpha_mean": token_metric(alpha, micro_batch),
                           "topr_negative_frac": token_metric(negative.float(), micro_batch)}
