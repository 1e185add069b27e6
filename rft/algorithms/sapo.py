"""SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347): GRPO's advantages, a smooth
sigmoid gate on the ratio instead of PPO's hard clip.

    r_t   = exp(logp_t - prox_t),     tau = sapo_tau_pos if A_i > 0 else sapo_tau_neg
    f_t   = 4 / tau * sigmoid(tau * (r_t - 1))
    l_t   = -w_t * A_i * sg(f_t) * logp_t   +  kl_coef * k3_t
reduced by `algorithm.loss_agg` (token_mean, as Trinity-RFT). The gate is 2 / tau at r = 1 and decays smoothly as
the token's ratio leaves 1 (its slope at 1 is 1 for every tau); tau_neg > tau_pos damps negative-advantage tokens
faster, which the paper found stabler. This is Trinity-RFT's form, a detached gate times logp (the gradient is
-w A f(r) grad logp); the paper differentiates f(r) A itself (gradient -w A f'(r) r grad logp, the same sign and
shape around r = 1). prox and w are GRPO's. Defaults as the paper and Trinity-RFT: tau_pos 1.0, tau_neg 1.05;
`clip_eps*` are not used. Metrics: `sapo_gate_mean`, `sapo_ratio_mean`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rft.algorithms.aggregation import token_metric
from rft.algorithms.grpo import GRPO, GRPOOptions, token_ratio
from rft.algorithms.registry import Metrics, MicroBatch, register
from rft.config import POSITIVE, SectionError, option
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")


@dataclass(frozen=True)
class SAPOOptions(GRPOOptions):
    """GRPO's keys (advantages, KL, aggregation, correction; the clip keys are not used) and the gate's two
    temperatures."""
    sapo_tau_pos: float = option(1.0, range=POSITIVE, help="the gate's temperature on tokens with positive advantage")
    sapo_tau_neg: float = option(1.05, range=POSITIVE,
        help="the gate's temperature on tokens with zero or negative advantage (>= sapo_tau_pos)")

    def validate(self) -> None:
        super().validate()
        if self.sapo_tau_neg < self.sapo_tau_pos:
            raise SectionError("sapo_tau_neg", f"must be >= sapo_tau_pos ({self.sapo_tau_pos}), got "
                               f"{self.sapo_tau_neg}: negative samples are the ones to damp faster")


@register("sapo", options=SAPOOptions)
class SAPO(GRPO):
    cfg: SAPOOptions

    def policy_loss(self, logp: torch.Tensor, micro_batch: MicroBatch, prox: torch.Tensor,
                    weight: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        advantage = micro_batch["advantages"].float()[:, None]
        ratio = token_ratio(logp.detach(), prox, micro_batch)
        tau = torch.where(advantage > 0, self.cfg.sapo_tau_pos, self.cfg.sapo_tau_neg)
        gate = 4.0 / tau * torch.sigmoid(tau * (ratio - 1))
        per_token = -(weight * gate).detach() * advantage * logp
        return per_token, {"sapo_gate_mean": token_metric(gate, micro_batch),
                           "sapo_ratio_mean": token_metric(ratio, micro_batch)}
