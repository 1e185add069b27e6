"""Off-policy corrections of the policy-gradient losses: the behaviour weight w of the decoupled objective, in one
place for every algorithm built on GRPO's loss (rft/algorithms/grpo.py).

Three policies (rft/algorithms/grpo.py): behaviour (`old_logprobs`, behav: the engine's, of the version that
generated each token), proximal (prox: the weights the step starts from) and current (logp). With
`off_policy_correction: true` (decoupled PPO) the loss of token t is

    l_t = -w_t * min(r_t A, clip(r_t) A),   r_t = exp(logp_t - prox_t),   rho_t = exp(prox_t - behav_t)

with w_t a constant (no gradient):
    tis (default)   w_t = min(rho_t, importance_cap)
    mis             w_t = rho_t if importance_floor <= rho_t <= importance_cap, else 0 (the token leaves the loss)
    sequence_mask H g_i = exp(sum_t m_t log rho_t / |y_i|);  w_t *= 1[1/H <= g_i <= H] for every token of sample i
The sequence mask combines with either token rule. `level="sequence"` (gspo) replaces log rho_t by the sample's
mean first. Without `off_policy_correction`, prox = behav and w = 1; asking for mis or a sequence mask is then a
config error naming the key.

Metrics (step-sum contributions): `importance_weight_truncated_frac` (tis: rho_t >= cap), `importance_masked_frac`
(weight 0), `sequence_masked_frac` (samples masked out); the loss adds `importance_weight_mean`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rft.algorithms.aggregation import token_metric
from rft.config import PROBABILITY, Range, Section, SectionError, at_least, option
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")

IMPORTANCE_SAMPLING = ("tis", "mis")


@dataclass(frozen=True)
class CorrectionOptions(Section):
    """The keys of the off-policy correction (module docstring); every policy-gradient algorithm's options extend
    this dataclass."""
    KEY = "algorithm"
    off_policy_correction: bool = option(False,
        help="decoupled PPO: the trust region centred on the policy the step starts from, each token weighted by its "
        "behaviour weight (importance_sampling); correct on old experiences")
    importance_sampling: Literal["tis", "mis"] = option("tis",
        help="off_policy_correction's token weight of rho = pi_prox / pi_behav: tis min(rho, importance_cap); mis rho "
        "inside [importance_floor, importance_cap], else 0 (IcePop's token mask)")
    importance_cap: float = option(2.0, range=at_least(1),
        help="off_policy_correction: tis truncates the behaviour weight here; mis masks tokens above it")
    importance_floor: float = option(0.5, range=PROBABILITY,
        help="off_policy_correction with mis: tokens whose rho is below it leave the loss")
    sequence_mask: float | None = option(None, range=Range(low=1, low_open=True, note="null: off"),
        help="off_policy_correction: a sample whose geometric-mean rho is outside [1/sequence_mask, sequence_mask] "
        "leaves the loss (IcePop-style sequence masking); null: none")

    def validate(self) -> None:
        """The combinations (the ranges are the fields')."""
        if not self.off_policy_correction:
            if self.importance_sampling != "tis":
                raise SectionError("importance_sampling", f"{self.importance_sampling} weights the decoupled "
                                   "objective; set algorithm.off_policy_correction: true")
            if self.sequence_mask is not None:
                raise SectionError("sequence_mask", "masks by the behaviour ratio of the decoupled objective; set "
                                   "algorithm.off_policy_correction: true")


def sequence_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[b]: the mean of `per_token` over each row's loss tokens (0 for a row without any; masked values, which may
    be anything, never reach the sum)."""
    return torch.where(mask, per_token, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)


def behaviour_weight(log_rho: torch.Tensor, micro_batch: dict[str, torch.Tensor], options: CorrectionOptions, *,
                     level: Literal["token", "sequence"] = "token") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(w [b, T], metrics) of the module docstring from `log_rho` = prox - behav [b, T] (detached), over the
    micro-batch's `loss_mask`; w is 0 outside the mask. Metrics are contributions to step-wide sums
    (`global_tokens`, `global_sequences`)."""
    mask = micro_batch["loss_mask"] > 0
    log_rho = torch.where(mask, log_rho.detach().float(), 0.0)  # padding may hold anything
    geometric = sequence_mean(log_rho, mask)  # [b]: log g_i
    if level == "sequence":
        log_rho = torch.where(mask, geometric[:, None].expand_as(log_rho), 0.0)
    elif level != "token":
        raise ValueError(f"behaviour_weight: level must be token or sequence, got {level!r}")
    rho = torch.exp(log_rho)
    cap = options.importance_cap
    metrics: dict[str, torch.Tensor] = {}
    if options.importance_sampling == "tis":
        weight = rho.clamp(max=cap)
        metrics["importance_weight_truncated_frac"] = token_metric((rho >= cap).float(), micro_batch)
    elif options.importance_sampling == "mis":
        weight = torch.where((rho >= options.importance_floor) & (rho <= cap), rho, 0.0)
    else:
        raise ValueError(f"algorithm.importance_sampling: must be one of {', '.join(IMPORTANCE_SAMPLING)}, got "
                         f"{options.importance_sampling!r}")
    if options.sequence_mask is not None:
        bound = math.log(options.sequence_mask)
        kept = (geometric >= -bound) & (geometric <= bound)
        weight = weight * kept[:, None]
        real = mask.any(-1)
        metrics["sequence_masked_frac"] = ((~kept & real).float().sum()
                                           / micro_batch["global_sequences"].clamp(min=1)).detach()
    weight = torch.where(mask, weight, 0.0)
    if options.importance_sampling == "mis" or options.sequence_mask is not None:
        metrics["importance_masked_frac"] = token_metric((weight == 0).float(), micro_batch)
    return weight, metrics
