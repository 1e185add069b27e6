"""REC series (Yao et al. 2025, "Group-relative REINFORCE is secretly an off-policy algorithm"; Trinity-RFT's `rec`):
REINFORCE with a group baseline, where a token leaves the loss outside a clip region, optionally weighted, optionally
regularised.

    A_i  = r_i - mean(r)     (std_normalize: true divides by the group std; a group of one: 0)
    rho_t = sg(exp(logp_t - prox_t)),   s_i = sg(exp(sum_t m_t (logp_t - prox_t) / |y_i|))   (sequence ratio)
    keep_t (rec_clip_mode), with [lo, hi] = [1 - eps_low, 1 + eps_high] (clip_eps_low / clip_eps_high, 0.2 each):
        none       1
        one_side   A >= 0 and rho <= hi,  or  A <= 0 and rho >= lo        (PPO's active side only)
        two_side   lo <= rho <= hi
        ring       two_side, or A >= 0 and rho <= 1 - rec_eps_low_prime, or A <= 0 and rho >= 1 + rec_eps_high_prime
    A'_it (rec_weight):  none A_i;  token_is A_i rho_t;  sequence_is A_i s_i;  advantage A_i exp(A_i / rec_temp)
    l_t  = -w_t * A'_it * logp_t * keep_t  +  reg_t  +  kl_coef * k3_t
    reg_t (rec_regularizer, c = rec_regularizer_coef):  none 0;  forward_kl -c logp_t;  k2 c (logp_t - prox_t)^2
reduced by `algorithm.loss_agg` (token_mean, Trinity-RFT's masked mean). The names of the paper's variants:
REINFORCE = none/none, OneSide-NoIS = one_side/none, OneSide-IS = one_side/token_is, TwoSide-IS = two_side/token_is,
Ring-NoIS = ring/none. prox and w are GRPO's (the behaviour policy and 1 without `off_policy_correction`); Trinity-RFT's
k2 term is taken against the behaviour policy, which is prox here. Not implemented: Trinity-RFT's experimental
`gspo-one-side` clip mode and its advantage's random `drop: balance` of surplus negative samples. The group std,
when used, has Bessel's correction (GRPO's; Trinity-RFT's REC: the population std). Metric `clip_frac`: tokens not kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rft.algorithms.aggregation import token_metric
from rft.algorithms.correction import sequence_mean
from rft.algorithms.grpo import GRPO, GRPOOptions, token_ratio
from rft.algorithms.registry import Metrics, MicroBatch, register
from rft.config import POSITIVE, at_least, option
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")


@dataclass(frozen=True)
class RECOptions(GRPOOptions):
    """GRPO's keys (clip_eps_low / clip_eps_high: the trust region; std_normalize false by default) and REC's."""
    std_normalize: bool = option(False,
        help="divide group-centred rewards by the group std (rec's default false: the group mean baseline)")
    rec_clip_mode: Literal["none", "one_side", "two_side", "ring"] = option("none",
        help="which tokens stay in the loss: all, PPO's active side, inside the trust region, or the ring")
    rec_weight: Literal["none", "token_is", "sequence_is", "advantage"] = option("none",
        help="the advantage's weight: 1, the token ratio, the sequence ratio, or exp(A / rec_temp)")
    rec_temp: float = option(1.0, range=POSITIVE, help="the temperature of rec_weight: advantage")
    rec_regularizer: Literal["none", "forward_kl", "k2"] = option("none",
        help="forward_kl: -c logp; k2: c (logp - prox)^2, with c = rec_regularizer_coef")
    rec_regularizer_coef: float = option(0.0, range=at_least(0, "0: none"), help="the regulariser's weight")
    rec_eps_low_prime: float = option(0.6, range=POSITIVE,
        help="ring: tokens with A >= 0 and ratio <= 1 - rec_eps_low_prime stay in the loss")
    rec_eps_high_prime: float = option(2.0, range=POSITIVE,
        help="ring: tokens with A <= 0 and ratio >= 1 + rec_eps_high_prime stay in the loss")


@register("rec", options=RECOptions)
class REC(GRPO):
    cfg: RECOptions

    def policy_loss(self, logp: torch.Tensor, micro_batch: MicroBatch, prox: torch.Tensor,
                    weight: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        c, mask = self.cfg, micro_batch["loss_mask"] > 0
        advantage = micro_batch["advantages"].float()[:, None].expand_as(logp)
        ratio = token_ratio(logp.detach(), prox, micro_batch)
        low, high = 1 - self.clip_low, 1 + self.clip_high
        up, down = advantage >= 0, advantage <= 0
        inside = (ratio >= low) & (ratio <= high)
        if c.rec_clip_mode == "none":
            keep = torch.ones_like(inside)
        elif c.rec_clip_mode == "one_side":
            keep = (up & (ratio <= high)) | (down & (ratio >= low))
        elif c.rec_clip_mode == "two_side":
            keep = inside
        else:  # ring
            keep = inside | (up & (ratio <= 1 - c.rec_eps_low_prime)) | (down & (ratio >= 1 + c.rec_eps_high_prime))
        if c.rec_weight == "token_is":
            advantage = advantage * ratio
        elif c.rec_weight == "sequence_is":
            advantage = advantage * torch.exp(sequence_mean(logp.detach() - prox, mask))[:, None]
        elif c.rec_weight == "advantage":
            advantage = advantage * torch.exp(advantage / c.rec_temp)
        per_token = -weight.detach() * advantage * logp * keep.float()
        if c.rec_regularizer == "forward_kl":
            per_token = per_token - c.rec_regularizer_coef * logp
        elif c.rec_regularizer == "k2":
            per_token = per_token + c.rec_regularizer_coef * torch.where(mask, logp - prox, 0.0) ** 2
        return per_token, {"clip_frac": token_metric((~keep).float(), micro_batch)}
