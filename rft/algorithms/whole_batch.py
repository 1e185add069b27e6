"""Token decisions over a whole optimizer batch spread over data-parallel ranks: the helpers of `Needs.step_start`'s
`prepare` (rft/algorithms/registry.py `StepStart`; M2PO, Clip_B, Clip_V).

Each rank holds its share of the step's micro-batches; a step-wide statistic is a sum of per-rank sums, taken by the
trainer's `sum_over_replicas` (a float64 CPU tensor summed over the data-parallel ranks). Every function here is
collective: all ranks call it in the same order, and each call all-reduces a fixed number of times whatever the data
(the bisection below evaluates exactly as many thresholds on every rank).

A global cutoff (M2PO's "drop the largest (log r)^2 until the mean is <= 0.04", Clip_V's "clip at most the K most
violating tokens") is found by bisection on the threshold rather than by gathering the values: for non-negative
float32 values the order of the values is the order of their IEEE-754 bit patterns read as integers, so a bisection
over the integers 0 .. 0x7F800000 (+inf) finds the exact float32 threshold in at most 32 steps of one all-reduce of a
few float64 numbers each, with memory independent of the batch. It keeps or drops tied values together, where a sort
could split a tie at the boundary (equal float32 values of (log r)^2 at the cutoff: rare, and either choice meets the
rule's bound).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")

SumOverReplicas = Callable[["torch.Tensor"], "torch.Tensor"]
INF_BITS = 0x7F800000  # the float32 bit pattern of +inf


def float32_of_bits(bits: int) -> float:
    """The float32 whose bit pattern is the non-negative integer `bits`."""
    return float(torch.tensor([bits], dtype=torch.int32).view(torch.float32)[0])


def largest_true(predicate: Callable[[float], bool]) -> float:
    """The largest non-negative float32 c (+inf included) with `predicate(c)` True, for a predicate that is True up
    to some point and False after it; -inf when it is False at 0. Evaluates it exactly 31 times (collective
    predicates stay in step on every rank)."""
    lo, hi = -1, INF_BITS + 1  # predicate(lo) True and predicate(hi) False, by convention
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if predicate(float32_of_bits(mid)):
            lo = mid
        else:
            hi = mid
    return -math.inf if lo < 0 else float32_of_bits(lo)


def global_sums(parts: list, sum_over_replicas: SumOverReplicas) -> list[float]:
    """`parts` (this rank's numbers or 0-d tensors) summed over the data-parallel ranks, as floats (float64 on the
    way)."""
    local = torch.tensor([float(x) for x in parts], dtype=torch.float64)
    return [float(x) for x in sum_over_replicas(local).tolist()]


def flat_values(tensors: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
    """The values of `tensors` where `masks` hold, as one float32 vector (this rank's); ValueError on a non-finite
    one (the start log-probs and the recorded ones are finite where a loss reads them)."""
    values = torch.cat([t.float()[m].reshape(-1) for t, m in zip(tensors, masks, strict=True)]) if tensors \
        else torch.zeros(0)
    if not bool(torch.isfinite(values).all()):
        raise ValueError("whole-batch token statistics: a non-finite value at a loss token (start or recorded "
                         "log-probs)")
    return values


def mean_and_std(values: torch.Tensor, sum_over_replicas: SumOverReplicas) -> tuple[float, float, float]:
    """(count, mean, population standard deviation) of `values` over all ranks' (two passes: the mean, then the
    squared deviations); (0, 0, 0) when there are none."""
    count, total = global_sums([values.numel(), values.double().sum()], sum_over_replicas)
    mean = total / count if count else 0.0
    (square,) = global_sums([(values.double() - mean).square().sum()], sum_over_replicas)
    return count, mean, math.sqrt(square / count) if count else 0.0


def replace_loss_masks(micro_batches: list[dict], masks: list[torch.Tensor],
                       sum_over_replicas: SumOverReplicas) -> list[dict]:
    """`micro_batches` with `loss_mask` replaced by `masks` (each within the old mask) and the step's token counts
    that normalise losses and metrics recounted over all ranks: `global_tokens`, and `staleness_tokens` where the
    micro-batches carry it (rft/trainer/batch.py). Tokens outside the new masks leave the loss and its token means,
    as a token dropped from Trinity-RFT's response_mask."""
    from rft.algorithms.mismatch import STALENESS_BUCKETS  # heavy: torch (a config check imports this module)

    counts = torch.zeros(1 + STALENESS_BUCKETS, dtype=torch.float64)
    for mb, mask in zip(micro_batches, masks, strict=True):
        kept = mask & (mb["loss_mask"] > 0)
        counts[0] += kept.sum()
        if "staleness_bucket" in mb:
            bucket = mb["staleness_bucket"]
            for b in range(STALENESS_BUCKETS):
                counts[1 + b] += (kept & (bucket == b)).sum()
    totals = sum_over_replicas(counts)
    out = []
    for mb, mask in zip(micro_batches, masks, strict=True):
        new = {**mb, "loss_mask": (mask & (mb["loss_mask"] > 0)).to(mb["loss_mask"].dtype),
               "global_tokens": totals[0].to(torch.float32)}
        if "staleness_tokens" in mb:
            new["staleness_tokens"] = totals[1:].to(mb["staleness_tokens"].dtype)
        out.append(new)
    return out
