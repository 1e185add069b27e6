"""SFT: masked negative log-likelihood of the response tokens (rewards and advantages are ignored).

    l_t = -logp_t,   reduced by `algorithm.loss_agg` (token_mean: per token; seq_mean: per sequence, then mean).
Uses recorded experiences only, so it runs in offline replay; no reference model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rft.algorithms.aggregation import aggregate, check_micro_batch, token_metric
from rft.algorithms.registry import Algorithm, Metrics, MicroBatch, register, zero_advantages
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")


@dataclass
class SFTOptions:
    # token_mean: the NLL per loss token of the step; seq_mean: per sequence first
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"


@register("sft", options=SFTOptions)
class SFT(Algorithm):
    supports_replay = True
    advantages = staticmethod(zero_advantages)

    def __init__(self, options: SFTOptions):
        self.cfg = options

    def loss_fn(self, token_logprobs: torch.Tensor, micro_batch: MicroBatch) -> tuple[torch.Tensor, Metrics]:
        check_micro_batch(token_logprobs, micro_batch, ["loss_mask", "global_tokens", "global_sequences"],
                          algorithm=self.name)
        nll = -token_logprobs.float()
        return aggregate(nll, micro_batch, self.cfg.loss_agg), {"neg_logprob": token_metric(nll, micro_batch)}
