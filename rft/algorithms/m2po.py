"""M2PO (Zheng et al. 2025, "Second-Moment Trust Policy Optimization"; Trinity-RFT's `m2po` policy loss): stable
training on stale rollouts by bounding the second moment of the log importance ratio over the whole optimizer batch,
dropping only its extreme tokens.

With GRPO's advantages A_i and, per loss token, l_t = log r_t = logp_t - behav_t (the current policy against the
behaviour policy that sampled the token, `old_logprobs`):
    trust region  T = {t : A_i > 0 and l_t > 0, or A_i < 0 and l_t < 0}   (where PPO's clip would act)
    mask          over all of T in the step (every data-parallel rank), drop the tokens with the largest l_t^2 until
                  the mean of l_t^2 over the kept ones of T is <= m2_threshold (0.04); tokens outside T are kept
    loss          -(1/N) sum_{kept t} A_i * exp(clamp(l_t, +-log_ratio_clip))   (value clamped, gradient of l_t)
with N every loss token of the step (`global_tokens`: the dropped tokens stay in the denominator, the paper's
footnote 2). The mask is chosen before the step from the log-probs at the weights the step starts from
(`Needs.step_start`: equal in value to logp, one step being one update) and the cutoff is global: a bisection on the
float32 threshold with sums all-reduced over the data-parallel ranks (rft/algorithms/whole_batch.py), as Trinity-RFT's
later version computes it over the complete global mini-batch. No clip (`clip_eps*` unused), no off-policy correction
(the ratio is to the behaviour policy already: off_policy_correction is refused), token_mean only (seq_mean refused).
Correct on recorded experiences of any age (supports replay). Keys: GRPO's plus `m2_threshold`, `log_ratio_clip`.
Metrics: `m2po_ratio_mean` (token mean of r); per step `m2po_m2_before` / `m2po_m2_after` (mean l^2 over T before and
after the drop), `m2po_masked_frac` (dropped / loss tokens), `m2po_trust_region_frac` (|T| / loss tokens).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rft.algorithms.aggregation import token_metric
from rft.algorithms.grpo import GRPO, GRPOOptions
from rft.algorithms.registry import Metrics, MicroBatch, StepStart, register
from rft.algorithms.whole_batch import SumOverReplicas, flat_values, global_sums, largest_true
from rft.config import POSITIVE, SectionError, at_least, option
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")


@dataclass(frozen=True)
class M2POOptions(GRPOOptions):
    """GRPO's keys (clip_eps* unused) and the second-moment bound."""
    m2_threshold: float = option(0.04, range=at_least(0),
        help="m2po: the bound on the mean (log r)^2 over the trust-region tokens of the step; the largest are dropped "
        "until it holds")
    log_ratio_clip: float = option(20.0, range=POSITIVE,
        help="m2po: the log-ratio's value is clamped to +-log_ratio_clip inside exp (its gradient is not)")

    def validate(self) -> None:
        super().validate()
        if self.off_policy_correction:
            raise SectionError("off_policy_correction", "m2po's ratio is already to the behaviour policy and its mask "
                               "is the trust region; leave it false")
        if self.loss_agg != "token_mean":
            raise SectionError("loss_agg", "m2po divides by all loss tokens of the step (token_mean), as the paper")


def trust_region(micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(T [b, T] bool, l^2 [b, T] float32) of the module docstring from `start_logprobs` and `old_logprobs`."""
    mask = micro_batch["loss_mask"] > 0
    log_ratio = torch.where(mask, micro_batch["start_logprobs"].float() - micro_batch["old_logprobs"].float(), 0.0)
    advantage = micro_batch["advantages"].float()[:, None]
    trust = mask & (((advantage > 0) & (log_ratio > 0)) | ((advantage < 0) & (log_ratio < 0)))
    return trust, log_ratio.square()


def m2_cutoff(values: torch.Tensor, threshold: float, sum_over_replicas: SumOverReplicas) -> float:
    """The largest float32 c such that the mean of all ranks' `values` <= c is <= `threshold` (an empty set's mean
    counts as 0): values above it are dropped. Collective: 31 all-reduces."""
    def holds(c: float) -> bool:
        kept = values <= c
        count, total = global_sums([kept.sum(), values[kept].double().sum()], sum_over_replicas)
        return count == 0 or total / count <= threshold
    return largest_true(holds)


@register("m2po", options=M2POOptions)
class M2PO(GRPO):
    cfg: M2POOptions
    extra_keys = ("m2po_mask",)

    def __init__(self, options: M2POOptions):
        super().__init__(options)
        self.supports_replay = True  # the ratio is to the behaviour policy: correct on experiences of any age
        self.needs = dataclasses.replace(self.needs, step_start=StepStart(prepare=self.prepare))
        self._step: dict[str, float] = {}

    def prepare(self, micro_batches: list[MicroBatch], sum_over_replicas: SumOverReplicas) -> list[MicroBatch]:
        """Each micro-batch with `m2po_mask` [b, T] (1: the token is kept), the cutoff global over the step."""
        regions = [trust_region(mb) for mb in micro_batches]
        values = flat_values([v for _, v in regions], [t for t, _ in regions])
        valid, count, total = global_sums([sum(float((mb["loss_mask"] > 0).sum()) for mb in micro_batches),
                                           values.numel(), values.double().sum()], sum_over_replicas)
        before = total / count if count else 0.0
        cutoff = m2_cutoff(values, self.cfg.m2_threshold, sum_over_replicas) if before > self.cfg.m2_threshold \
            else math.inf
        kept = values <= cutoff
        kept_count, kept_total = global_sums([kept.sum(), values[kept].double().sum()], sum_over_replicas)
        self._step = {"m2po_m2_before": before, "m2po_m2_after": kept_total / kept_count if kept_count else 0.0,
                      "m2po_masked_frac": (count - kept_count) / valid if valid else 0.0,
                      "m2po_trust_region_frac": count / valid if valid else 0.0}
        out = []
        for mb, (trust, square) in zip(micro_batches, regions, strict=True):
            keep = (mb["loss_mask"] > 0) & ~(trust & (square > cutoff))
            out.append({**mb, "m2po_mask": keep.float()})
        return out

    def policy_loss(self, logp: torch.Tensor, micro_batch: MicroBatch, prox: torch.Tensor,
                    weight: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        mask = micro_batch["loss_mask"] > 0
        log_ratio = torch.where(mask, logp - prox, 0.0)  # prox is the behaviour policy (no off-policy correction)
        bound = self.cfg.log_ratio_clip
        ratio = torch.exp(log_ratio + (log_ratio.clamp(-bound, bound) - log_ratio).detach())
        advantage = micro_batch["advantages"].float()[:, None]
        per_token = torch.where(micro_batch["m2po_mask"] > 0, -advantage * ratio, 0.0)
        return per_token, {"m2po_ratio_mean": token_metric(ratio, micro_batch)}

    def step_metrics(self, step: int) -> dict[str, float]:
        return dict(self._step)
