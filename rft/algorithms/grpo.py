"""GRPO: group-normalised advantages, the clipped-ratio PPO objective, optional KL, optional off-policy correction.

Advantages, for one group of n samples (one task) with rewards r_1..r_n:
    A_i = (r_i - mean(r)) / (std(r) + eps)     std with Bessel's correction; a group of one gets 0
    A_i = r_i - mean(r)                         with algorithm.std_normalize: false (Dr. GRPO)
Loss of response token t of sample i (A_i broadcast over the sample's tokens):
    rho_t = exp(logp_t - prox_t)
    l_t   = -w_t * min(rho_t * A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_i)  +  kl_coef * k3_t
    k3_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1       (k3 estimator of KL(pi_theta || pi_ref))
reduced to the step loss by `algorithm.loss_agg` (aggregation.py); eps_low / eps_high are `clip_eps_low` /
`clip_eps_high`, each `clip_eps` when null. Subclasses replace the policy term (`policy_loss`: GSPO, CISPO) or the
advantages (RLOO, REINFORCE++) and keep the KL term, the behaviour weight w, aggregation and the common metrics.

Which log-probs play which role: logp = `token_logprobs` (the current policy, the only differentiated input);
behav = `old_logprobs` (the weights the explorer sampled with); ref = `ref_logprobs` (read only when kl_coef > 0);
prox = the centre of the trust region. `off_policy_correction: false`: prox = behav, w_t = 1.
`off_policy_correction: true` (decoupled PPO): prox = the policy the step starts from, w_t the behaviour weight of
exp(prox_t - behav_t) (rft/algorithms/correction.py); prox is `prox_logprobs`, else `token_logprobs` detached (exact:
one step is one optimizer update). Tokens outside `loss_mask` never reach the loss (log-ratios zeroed first).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from rft.algorithms.aggregation import aggregate, check_micro_batch, k3, token_metric
from rft.algorithms.correction import CorrectionOptions, behaviour_weight
from rft.algorithms.registry import Algorithm, Metrics, MicroBatch, Needs, register
from rft.config import POSITIVE, Range, at_least, option
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")

ADVANTAGE_EPS = 1e-6


@dataclass(frozen=True)
class GRPOOptions(CorrectionOptions):
    """The keys of grpo, rloo, reinforce_pp, gspo and cispo (and of the algorithms built on them: ppo, chord,
    on_policy_distill, whose options add their own); the off-policy correction's are CorrectionOptions'. Their
    ranges are the fields'; combinations an algorithm refuses are its own ConfigError, when it is built."""
    clip_eps: float = option(0.2, range=POSITIVE,
        help="the ratio's clip range on both sides (unless clip_eps_low / clip_eps_high); not used by gspo and cispo")
    clip_eps_low: float | None = option(None, range=Range(0, 1, low_open=True, note="1: no lower bound"),
        help="clip below at 1 - clip_eps_low; null: the algorithm's default (docs/algorithms.md)")
    clip_eps_high: float | None = option(None, range=POSITIVE,
        help="clip above at 1 + clip_eps_high (DAPO's clip-higher: 0.28); null: the algorithm's default")
    kl_coef: float = option(0.0, range=at_least(0, "0: none"),
        help="weight of the k3 KL term to the frozen reference model (> 0 loads the reference); 0: none")
    loss_agg: Literal["token_mean", "seq_mean"] = option("token_mean",
        help="token_mean: over all loss tokens of the step (DAPO); seq_mean: per sequence first (gspo: always)")
    std_normalize: bool = option(True,
        help="divide group-centred rewards by the group std (false: Dr. GRPO); not used by rloo, reinforce_pp and ppo")


@register("grpo", options=GRPOOptions)
class GRPO(Algorithm):
    """Subclasses that only change `group_advantages` (or `advantages`) are the REINFORCE-style variants; those that
    change `policy_loss` (and `default_clip`, `loss_agg`) are the other group policy losses."""

    default_clip: tuple[float, float] | None = None  # (eps_low, eps_high) when the config's are null; None: clip_eps
    # the behaviour weight per token, or per sequence (gspo): correction.py
    correction_level: Literal["token", "sequence"] = "token"
    extra_keys: tuple[str, ...] = ()  # micro-batch keys a subclass's policy term reads besides GRPO's

    def __init__(self, options: GRPOOptions):
        self.cfg = cfg = options
        self.needs = Needs(reference=cfg.kl_coef > 0)
        # Recorded experiences of any age are usable only when the loss corrects for the behaviour policy.
        self.supports_replay = cfg.off_policy_correction
        self.loss_agg = cfg.loss_agg
        low, high = self.default_clip or (cfg.clip_eps, cfg.clip_eps)
        self.clip_low = low if cfg.clip_eps_low is None else cfg.clip_eps_low
        self.clip_high = high if cfg.clip_eps_high is None else cfg.clip_eps_high

    # ---------------------------------------------------------------------------------------------- advantages

    def advantages(self, rewards_per_group: Sequence[np.ndarray]) -> list[np.ndarray]:
        groups = [finite_rewards(r, i) for i, r in enumerate(rewards_per_group)]
        return [self.group_advantages(r).astype(np.float32) for r in groups]

    def group_advantages(self, rewards: np.ndarray) -> np.ndarray:
        if len(rewards) < 2:
            return np.zeros_like(rewards)
        centred = rewards - rewards.mean()
        return centred / (rewards.std(ddof=1) + ADVANTAGE_EPS) if self.cfg.std_normalize else centred

    # ---------------------------------------------------------------------------------------------------- loss

    def loss_fn(self, token_logprobs: torch.Tensor, micro_batch: MicroBatch) -> tuple[torch.Tensor, Metrics]:
        keys = ["loss_mask", "old_logprobs", "advantages", "global_tokens", "global_sequences"]
        keys += list(self.extra_keys) + (["ref_logprobs"] if self.needs.reference else [])
        check_micro_batch(token_logprobs, micro_batch, keys, algorithm=self.name)
        logp, mask = token_logprobs.float(), micro_batch["loss_mask"] > 0
        prox, weight, correction = self._proximal(logp, micro_batch)
        per_token, metrics = self.policy_loss(logp, micro_batch, prox, weight)
        metrics = {"pg_loss": aggregate(per_token, micro_batch, self.loss_agg).detach(), **metrics,
                   "importance_weight_mean": token_metric(weight, micro_batch), **correction,
                   "neg_logprob": token_metric(-logp, micro_batch)}
        if self.needs.reference:
            kl = k3(micro_batch["ref_logprobs"] - logp, mask)  # KL(pi_theta || pi_ref), tokens drawn from pi_theta
            per_token = per_token + self.cfg.kl_coef * kl
            metrics["kl"] = token_metric(kl, micro_batch)
        return aggregate(per_token, micro_batch, self.loss_agg), metrics

    def policy_loss(self, logp: torch.Tensor, micro_batch: MicroBatch, prox: torch.Tensor,
                    weight: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        """The policy term per token [b, T] (before aggregation; masked tokens are ignored there) and its own
        metrics (contributions to step-wide sums). Here: the clipped surrogate of the module docstring."""
        return self.clipped_surrogate(logp, micro_batch, prox, weight, micro_batch["advantages"].float()[:, None])

    def clipped_surrogate(self, logp: torch.Tensor, micro_batch: MicroBatch, prox: torch.Tensor, weight: torch.Tensor,
                          advantage: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        """-w_t * min(rho_t A, clip(rho_t) A) per token [b, T] and its `clip_frac`; `advantage` is [b, 1] (one per
        sample) or [b, T] (one per token)."""
        ratio = token_ratio(logp, prox, micro_batch)
        clipped = ratio.clamp(1 - self.clip_low, 1 + self.clip_high)
        per_token = -weight * torch.minimum(ratio * advantage, clipped * advantage)
        return per_token, {"clip_frac": token_metric((clipped * advantage < ratio * advantage).float(), micro_batch)}

    def _proximal(self, logp: torch.Tensor, micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        """(prox log-probs, behaviour weight w [b, T], the correction's metrics); see the module docstring for the
        roles and rft/algorithms/correction.py for w."""
        behav = micro_batch["old_logprobs"]
        if not self.cfg.off_policy_correction:
            return behav, torch.ones_like(logp), {}
        prox = micro_batch["prox_logprobs"] if "prox_logprobs" in micro_batch else logp.detach()
        weight, metrics = behaviour_weight(prox - behav, micro_batch, self.cfg, level=self.correction_level)
        return prox, weight, metrics


def token_ratio(logp: torch.Tensor, prox: torch.Tensor, micro_batch: MicroBatch) -> torch.Tensor:
    """r_t = exp(logp_t - prox_t) [b, T], 1 outside `loss_mask` (the log-ratio is zeroed there first, so padding
    cannot overflow); differentiable through `logp` (detach it for a constant weight)."""
    return torch.exp(torch.where(micro_batch["loss_mask"] > 0, logp - prox, 0.0))


def finite_rewards(rewards: np.ndarray, index: int) -> np.ndarray:
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.ndim != 1:
        raise ValueError(f"advantages: group {index} rewards must be 1-D, got shape {rewards.shape}")
    if not np.all(np.isfinite(rewards)):
        raise ValueError(f"advantages: group {index} has non-finite rewards {rewards.tolist()}")
    return rewards
