"""CHORD (Zhang et al. 2025, "On-Policy RL Meets Off-Policy Experts"): expert demonstrations trained by SFT inside
the policy-gradient steps, with a scheduled weight.

A step's rows are the policy's own samples and expert demonstrations (`demo_mask` 1: one-sample groups from
rft/data/demonstrations.py). With mu = mu(step), loss = (1 - mu) * L_rl + mu * L_sft:
- L_rl: GRPO's loss (rft/algorithms/grpo.py) over the policy rows only, aggregated by `algorithm.loss_agg` with their
  own counts (global_tokens - global_demo_tokens, global_sequences - global_demo_sequences);
- L_sft: the NLL of the demonstration tokens, aggregated over global_demo_tokens / global_demo_sequences.
Demonstration tokens never enter L_rl, policy tokens never L_sft; each part is a sum over rows, so micro-batch and DP
splits change nothing (the batch contract).
Schedule (`chord_mu_schedule`), T = `chord_mu_steps`, p = min(step - 1, T) / T (1 when T = 0):
    linear: mu = mu_start + (mu_end - mu_start) * p
    cosine: mu = mu_end + (mu_start - mu_end) * (1 + cos(pi p)) / 2
so step 1 uses mu_start and steps T + 1 on mu_end (`step` is the micro-batch's, from 1). The paper's per-token
expert weighting phi is not implemented.
Micro-batch keys besides GRPO's: `demo_mask` [b], `global_demo_tokens`, `global_demo_sequences`, `step`. Metrics:
GRPO's (over policy rows), `rl_loss`, `sft_loss` (unweighted), and `kl` (the KL term when kl_coef > 0, else the
behaviour k3 over policy rows only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rft.algorithms.aggregation import aggregate, behaviour_kl, check_micro_batch
from rft.algorithms.grpo import GRPO, GRPOOptions
from rft.algorithms.registry import Demonstrations, Metrics, MicroBatch, Needs, register
from rft.config import COUNT, Range, at_least, option
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")

CHORD_KEYS = ["demo_mask", "global_demo_tokens", "global_demo_sequences", "step"]


def sft_weight(step: float, *, start: float, end: float, steps: int, schedule: str) -> float:
    """mu at optimizer step `step` (from 1), per the module docstring."""
    progress = 1.0 if steps == 0 else min(max(step - 1.0, 0.0), steps) / steps
    if schedule == "linear":
        return start + (end - start) * progress
    if schedule == "cosine":
        return end + (start - end) * (1.0 + math.cos(math.pi * progress)) / 2.0
    raise ValueError(f"algorithm.chord_mu_schedule: must be linear or cosine, got {schedule!r}")


@dataclass(frozen=True)
class ChordOptions(GRPOOptions):
    """GRPO's keys (the RL part) and the schedule and feed of the demonstrations."""
    chord_mu_start: float = option(0.9, range=Range(0, 1, note="the SFT share of the loss"),
        help="the SFT weight mu at step 1")
    chord_mu_end: float = option(0.05, range=Range(0, 1, note="the SFT share of the loss"),
        help="mu from step chord_mu_steps + 1 on")
    chord_mu_steps: int = option(100, range=at_least(0),
        help="steps over which mu goes from chord_mu_start to chord_mu_end")
    chord_mu_schedule: Literal["linear", "cosine"] = option("cosine", help="the shape of mu's decay")
    chord_topic: str = option("",
        help="the topic of demonstration groups; empty: <run>.demonstrations (rft run fills it from data)")
    chord_groups_per_step: int = option(2, range=COUNT,
        help="demonstration groups mixed into each step (besides run.groups_per_step)")


@register("chord", options=ChordOptions)
class CHORD(GRPO):
    cfg: ChordOptions

    def __init__(self, options: ChordOptions):
        super().__init__(options)
        # the demonstration rows, and the step for mu(step)
        self.needs = Needs(reference=self.needs.reference, step=True, demonstrations=Demonstrations(
            groups_per_step=options.chord_groups_per_step, topic=options.chord_topic))

    def mu(self, step: float) -> float:
        c = self.cfg
        return sft_weight(step, start=c.chord_mu_start, end=c.chord_mu_end, steps=c.chord_mu_steps,
                          schedule=c.chord_mu_schedule)

    def step_metrics(self, step: int) -> dict[str, float]:
        """`sft_mu`: the schedule's mu at `step`."""
        return {"sft_mu": self.mu(step)}

    def loss_fn(self, token_logprobs: torch.Tensor, micro_batch: MicroBatch) -> tuple[torch.Tensor, Metrics]:
        check_micro_batch(token_logprobs, micro_batch, ["loss_mask", "global_tokens", "global_sequences", *CHORD_KEYS],
                          algorithm=self.name)
        demo = micro_batch["demo_mask"].float()[:, None]
        demo_tokens, demo_sequences = micro_batch["global_demo_tokens"], micro_batch["global_demo_sequences"]
        policy_rows = {**micro_batch, "loss_mask": micro_batch["loss_mask"] * (1 - demo),
                       "global_tokens": micro_batch["global_tokens"] - demo_tokens,
                       "global_sequences": micro_batch["global_sequences"] - demo_sequences}
        demo_rows = {**micro_batch, "loss_mask": micro_batch["loss_mask"] * demo,
                     "global_tokens": demo_tokens, "global_sequences": demo_sequences}
        rl_loss, metrics = super().loss_fn(token_logprobs, policy_rows)
        sft_loss = aggregate(-token_logprobs.float(), demo_rows, self.loss_agg)
        mu = self.mu(float(micro_batch["step"]))
        if "kl" not in metrics:
            metrics["kl"] = behaviour_kl(token_logprobs, policy_rows)
        metrics.update(rl_loss=rl_loss.detach(), sft_loss=sft_loss.detach())
        return (1 - mu) * rl_loss + mu * sft_loss, metrics
