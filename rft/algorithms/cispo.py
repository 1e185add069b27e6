"""CISPO (MiniMax-M1, 2025): GRPO's advantages, a clipped and detached importance weight on the token log-prob.

Loss of response token t of sample i:
    r_t = exp(logp_t - prox_t)
    l_t = -w_t * sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_i * logp_t   +  kl_coef * k3_t
reduced by `algorithm.loss_agg` (token_mean by default, as the paper: a mean over all tokens of the batch). sg is
stop-gradient: the gradient of l_t is -w_t * clip(r_t) * A_i * grad logp_t. Unlike the PPO/GRPO surrogate no
token's gradient is ever cut off: clipping bounds the weight, so rare tokens far from the behaviour policy keep
contributing (the motivation of the paper). Defaults: eps_low = 1.0 (the lower clip is 0, i.e. none, as the paper
and Trinity-RFT) and eps_high = 0.28; set `algorithm.clip_eps_low` / `clip_eps_high` to change them.
`algorithm.clip_eps` is not used.

prox and w are GRPO's (rft/algorithms/grpo.py): without `off_policy_correction`, prox = the behaviour policy
(`old_logprobs`) and w = 1 (the paper's form); with it, prox = the policy the step starts from (r = 1 in value)
and w = the truncated behaviour importance weight, so the loss is a truncated importance-weighted policy gradient
that is correct on recorded experiences (`supports_replay`).
Metrics: `clip_frac` is the fraction of tokens whose weight was clipped, `is_weight_mean` the mean clipped weight.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rft.algorithms.aggregation import token_metric
from rft.algorithms.grpo import GRPO, GRPOOptions
from rft.algorithms.registry import Metrics, MicroBatch, register
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")


@register("cispo", options=GRPOOptions)
class CISPO(GRPO):
    default_clip = (1.0, 0.28)

    def policy_loss(self, logp: torch.Tensor, micro_batch: MicroBatch, prox: torch.Tensor,
                    weight: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        mask, advantage = micro_batch["loss_mask"] > 0, micro_batch["advantages"].float()[:, None]
        ratio = torch.exp(torch.where(mask, logp.detach() - prox, 0.0))
        is_weight = ratio.clamp(1 - self.clip_low, 1 + self.clip_high)
        per_token = -(weight * is_weight).detach() * advantage * torch.where(mask, logp, 0.0)
        return per_token, {"clip_frac": token_metric((is_weight != ratio).float(), micro_batch),
                           "is_weight_mean": token_metric(is_weight, micro_batch)}
