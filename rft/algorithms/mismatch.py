"""The training-inference log-probability mismatch: how far the trainer's log-probs of the sampled tokens are from
those the engine reported while sampling them (`old_logprobs`, from the version that generated each token).

With x_t = log p_trainer(y_t) - log p_rollout(y_t) over the step's loss tokens (demonstration rows left out), N those
tokens over the whole step (all micro-batches, all DP ranks) and r = `trainer.mismatch_ratio`:
    logprob_mismatch_mean = sum_t |x_t| / N
    logprob_mismatch_max  = max_t |x_t|                     (0 when the step has no such token)
    logprob_mismatch_kl   = sum_t (exp(x_t) - x_t - 1) / N   (k3 estimate of KL(rollout || trainer))
    logprob_mismatch_frac = #{t : |x_t| > log r} / N        (ratio outside [1/r, r])
and the same four per staleness, `logprob_mismatch_stale{s}_*` for s = 0..3 and `stale4plus`, over that staleness's
tokens. A token's staleness is (step - 1) - its version (rft.modes.staleness; per token with in-flight updates);
negative staleness (offline replay of another lineage) counts in the totals only. Computed in the training forward,
they measure numerics, MoE routing (`run.routing_replay` removes that part) and staleness; `stale0` is numerics and
routing alone.

Reduction contract (megatron_bridge.policy's `train_step`): `*_max` is reduced by max over micro-batches and DP ranks,
every other by sum; `*_mean`, `*_kl` and `*_frac` are each micro-batch's share of the step value (its token sum / N).
Every micro-batch of a step emits the same names (the staleness buckets present are step-wide: `staleness_tokens`,
rft/trainer/batch.py). `logprob_mismatch` computes the four for any subset of tokens.
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
