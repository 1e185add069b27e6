"""sPPO (Vaswani et al. 2022, "A general class of surrogate functions for stable and efficient RL", the token form
Trinity-RFT registers as `sppo`): the log-ratio instead of the ratio, and tokens outside the trust region dropped.

    A_i = r_i - mean(r)                                  (std_normalize false by default; a group of one: 0)
    l_t = -w_t * A_i * (logp_t - prox_t) * 1[1 / (1 + eps) <= sg(rho_t) <= 1 + eps]  +  kl_coef * k3_t
with rho_t = exp(logp_t - prox_t) and eps = `sppo_eps` (0.3, Trinity-RFT's). Inside the band the gradient is the
policy gradient -w A grad logp (the log-ratio's derivative is 1, not rho); outside it the token leaves the loss.
Reduced by `algorithm.loss_agg` (token_mean, as Trinity-RFT). prox and w are GRPO's (rft/algorithms/grpo.py);
`clip_eps*` are not used. Trinity-RFT's default advantage is OPMD's group mean, which std_normalize: false gives
(std_normalize: true: GRPO's normalised advantage). Metric `clip_frac`: tokens outside the band.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rft.algorithms.aggregation import token_metric
from rft.algorithms.grpo import GRPO, GRPOOptions, token_ratio
from rft.algorithms.registry import Metrics, MicroBatch, register
from rft.config import POSITIVE, option
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")


@dataclass(frozen=True)
class SPPOOptions(GRPOOptions):
    """GRPO's keys (std_normalize false by default) and the band's width."""
    std_normalize: bool = option(False,
        help="divide group-centred rewards by the group std (sppo's default false: the group mean baseline)")
    sppo_eps: float = option(0.3, range=POSITIVE,
        help="tokens whose ratio is outside [1 / (1 + sppo_eps), 1 + sppo_eps] leave the loss")


@register("sppo", options=SPPOOptions)
class SPPO(GRPO):
    cfg: SPPOOptions

    def policy_loss(self, logp: torch.Tensor, micro_batch: MicroBatch, prox: torch.Tensor,
                    weight: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        mask, advantage = micro_batch["loss_mask"] > 0, micro_batch["advantages"].float()[:, None]
        ratio = token_ratio(logp.detach(), prox, micro_batch)
        eps = self.cfg.sppo_eps
        inside = ((ratio >= 1 / (1 + eps)) & (ratio <= 1 + eps)).float()
        per_token = -weight.detach() * advantage * torch.where(mask, logp - prox, 0.0) * inside
        return per_token, {"clip_frac": token_metric(1 - inside, micro_batch)}
