"""The training-inference log-probability mismatch: how far the trainer's log-probs of the sampled tokens are from
those the inference engine reported while sampling them (the records' behaviour log-probs, `old_logprobs`: each
token's, from the weights version that generated it).

With x_t = log p_trainer(y_t) - log p_rollout(y_t) over the step's response tokens that enter the loss
(loss_mask > 0, demonstration rows left out: their recorded log-probs are not an engine's), N those tokens over the
whole step (all micro-batches, all data-parallel ranks) and r = `trainer.mismatch_ratio`:
    logprob_mismatch_mean = sum_t |x_t| / N
    logprob_mismatch_max  = max_t |x_t|                    (0 when the step has no such token)
    logprob_mismatch_kl   = sum_t (exp(x_t) - x_t - 1) / N  (k3 estimate of KL(rollout || trainer): the tokens were
                                                           drawn from the rollout policy)
    logprob_mismatch_frac = #{t : |x_t| > log r} / N       (tokens whose probability ratio is outside [1/r, r])
and the same four split by staleness, `logprob_mismatch_stale{s}_*` for s = 0, 1, 2, 3 and `stale4plus` (4 or
more), each over the tokens of that staleness (N_s of them), for the staleness values present in the step. A token's
staleness is (step - 1) - the version that generated it (rft.modes.staleness; per token: with in-flight weight
updates one sample's tokens may come from several versions, rft.schema `version_spans`); tokens of negative staleness
(offline replay of another lineage) are in the totals only.

All are computed per micro-batch in the training forward (the weights the step starts from), so they measure what
the engine and the trainer disagree on: numerics (dtype, kernels), MoE routing (a token routed to other experts;
`run.routing_replay` removes that part), and staleness (records of an older policy version): `stale0` is the
numerics and routing alone, the older buckets add the policy's own movement.

Reduction contract (megatron_bridge.policy's `train_step`): a metric named `*_max` is reduced by max over
micro-batches and data-parallel ranks, every other by sum; `*_mean`, `*_kl` and `*_frac` are emitted as each
micro-batch's share of the step value (its token sum / N), so the sum of shares is the step value. Every micro-batch
of a step emits the same names: the staleness buckets present are known step-wide (`staleness_tokens`, the batch
contract: rft/trainer/batch.py). `logprob_mismatch` is the one function that computes the four for any subset of
tokens.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from rft.algorithms.aggregation import k3

LossFn = Callable[[torch.Tensor, dict], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]

PREFIX = "logprob_mismatch"
STALENESS_BUCKETS = 5  # staleness 0, 1, 2, 3, and 4 or more


def bucket_name(bucket: int) -> str:
    """`stale0` .. `stale3`, and `stale4plus` for the last bucket (4 or more versions)."""
    return f"stale{bucket}plus" if bucket == STALENESS_BUCKETS - 1 else f"stale{bucket}"


def staleness_buckets(staleness: np.ndarray) -> np.ndarray:
    """The bucket of each token's staleness (int64, same shape): the staleness itself up to 3, 4 for 4 or more, -1
    for a negative staleness (not split)."""
    staleness = np.asarray(staleness, dtype=np.int64)
    return np.where(staleness < 0, -1, np.minimum(staleness, STALENESS_BUCKETS - 1))


def logprob_mismatch(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                     normaliser: torch.Tensor | float, prefix: str = PREFIX,
                     ratio: float = 2.0) -> dict[str, torch.Tensor]:
    """`{prefix}_mean`, `_kl`, `_frac`: this micro-batch's shares (token sums / `normaliser`) of the step values of
    the module docstring over the tokens `mask` selects; `{prefix}_max`: the largest |trainer - rollout| among them
    (0.0 where `mask` selects nothing). `ratio` (> 1) is r of `_frac`.

    Arguments are [b, T] tensors aligned on target positions (natural-log probabilities, float); `mask` is
    boolean or 0/1; `normaliser` is the number of selected tokens over the whole step (clamped to >= 1). Detached
    float64 scalars: metrics, no gradient."""
    if trainer_logprobs.shape != rollout_logprobs.shape or trainer_logprobs.shape != mask.shape:
        raise ValueError(f"logprob_mismatch: trainer {tuple(trainer_logprobs.shape)}, rollout "
                         f"{tuple(rollout_logprobs.shape)} and mask {tuple(mask.shape)} must have one [b, T] shape")
    with torch.no_grad():
        selected = mask > 0
        x = torch.where(selected, trainer_logprobs.detach().double() - rollout_logprobs.double(), 0.0)  # padding
        gap = x.abs()  # may hold anything, even inf: zeroed above
        normaliser = torch.as_tensor(normaliser, dtype=torch.float64, device=gap.device).clamp(min=1)
        return {f"{prefix}_mean": gap.sum() / normaliser,
                f"{prefix}_max": gap.max(),
                f"{prefix}_kl": k3(x, selected).sum() / normaliser,
                f"{prefix}_frac": (selected & (gap > math.log(ratio))).double().sum() / normaliser}


def with_mismatch_metrics(loss_fn: LossFn, *, ratio: float = 2.0) -> LossFn:
    """`loss_fn` that also reports the module docstring's `logprob_mismatch_*` from the micro-batch's `old_logprobs`
    and `loss_mask`, leaving out demonstration rows (`demo_mask`) and their tokens (`global_demo_tokens`); split by
    staleness when the micro-batch carries `staleness_bucket` [b, T] and `staleness_tokens` [STALENESS_BUCKETS]."""
    if not ratio > 1:
        raise ValueError(f"trainer.mismatch_ratio: must be > 1, got {ratio}")

    def loss_with_mismatch(token_logprobs: torch.Tensor, micro_batch: dict[str, torch.Tensor]):
        loss, metrics = loss_fn(token_logprobs, micro_batch)
        mask = micro_batch["loss_mask"] > 0
        normaliser = micro_batch["global_tokens"]
        if "demo_mask" in micro_batch:
            mask = mask & (micro_batch["demo_mask"][:, None] == 0)
            normaliser = normaliser - micro_batch.get("global_demo_tokens", 0.0)
        behaviour = micro_batch["old_logprobs"]
        metrics = {**metrics, **logprob_mismatch(token_logprobs, behaviour, mask, normaliser=normaliser,
                                                 ratio=ratio)}
        if "staleness_bucket" in micro_batch:
            buckets, counts = micro_batch["staleness_bucket"], micro_batch["staleness_tokens"]
            for bucket in range(STALENESS_BUCKETS):
                if float(counts[bucket]) > 0:
                    metrics.update(logprob_mismatch(token_logprobs, behaviour, mask & (buckets == bucket),
                                                    normaliser=counts[bucket], ratio=ratio,
                                                    prefix=f"{PREFIX}_{bucket_name(bucket)}"))
        return loss, metrics
    return loss_with_mismatch
