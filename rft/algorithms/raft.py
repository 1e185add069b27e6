"""RAFT (Dong et al. 2023, "Reward rAnked FineTuning"): SFT on the policy's own best rollouts.

Each group keeps the samples whose reward is its maximum (`raft_best_only: true`, RAFT's best-of-n) or every sample
(false), in both cases only those with reward > `raft_threshold`; the loss is the negative log-likelihood of the kept
samples' response tokens:
    w_i = B / K for a kept sample, 0 otherwise      (B: samples of the optimizer step, K: kept ones; K = 0: all 0)
    l_t = -w_i * logp_t,     reduced by `algorithm.loss_agg`
With seq_mean the step loss is exactly the mean over kept sequences of their per-token NLL (B / K undoes the
dropped samples' share of the denominator); with token_mean (the default) it is the NLL per loss token of the step
rescaled by the kept share of samples, exact when samples are of equal length. w_i travels as the sample's
`advantages` (computed once per step from every group, the same on every rank). Trinity-RFT's `raft` is its SFT loss
on experiences a workflow or buffer filter has already chosen; here the choice is the algorithm's. No reference, no
ratio: correct on recorded experiences of any age (`supports_replay`). Use it as a simple, stable baseline for
verifiable rewards, or to bootstrap a policy that already solves some tasks. Metric `raft_kept_frac` (samples kept).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from rft.algorithms.aggregation import aggregate, check_micro_batch, token_metric
from rft.algorithms.grpo import finite_rewards
from rft.algorithms.registry import Algorithm, Metrics, MicroBatch, register
from rft.config import FINITE, Section, option
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")


@dataclass(frozen=True)
class RAFTOptions(Section):
    KEY = "algorithm"
    raft_threshold: float = option(0.0, range=FINITE,
        help="only samples with reward > raft_threshold are trained on")
    raft_best_only: bool = option(True,
        help="true: of each group only the samples with its best reward (best-of-n); false: every sample above "
        "raft_threshold")
    loss_agg: Literal["token_mean", "seq_mean"] = option("token_mean",
        help="token_mean: the NLL per loss token of the step; seq_mean: per kept sequence first")


@register("raft", options=RAFTOptions)
class RAFT(Algorithm):
    supports_replay = True

    def __init__(self, options: RAFTOptions):
        self.cfg = options

    def advantages(self, rewards_per_group: Sequence[np.ndarray]) -> list[np.ndarray]:
        """w_i of the module docstring per sample."""
        groups = [finite_rewards(r, i) for i, r in enumerate(rewards_per_group)]
        kept = [(r > self.cfg.raft_threshold) & ((r == r.max()) if self.cfg.raft_best_only and len(r) else True)
                for r in groups]
        total, count = sum(len(r) for r in groups), sum(int(k.sum()) for k in kept)
        scale = total / count if count else 0.0
        return [(k * scale).astype(np.float32) for k in kept]

    def loss_fn(self, token_logprobs: torch.Tensor, micro_batch: MicroBatch) -> tuple[torch.Tensor, Metrics]:
        check_micro_batch(token_logprobs, micro_batch, ["loss_mask", "advantages", "global_tokens",
                                                        "global_sequences"], algorithm=self.name)
        weight = micro_batch["advantages"].float()
        nll = -token_logprobs.float()
        real = (micro_batch["loss_mask"].sum(-1) > 0).float()
        return aggregate(weight[:, None] * nll, micro_batch, self.cfg.loss_agg), {
            "neg_logprob": token_metric(nll, micro_batch),
            "raft_kept_frac": ((weight > 0).float() * real).sum() / micro_batch["global_sequences"].clamp(min=1)}
