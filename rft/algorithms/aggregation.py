"""Per-token values -> one micro-batch's contribution to the optimizer step's loss (the batch contract).

With m the loss mask, N = `global_tokens` and S = `global_sequences` (counted over all micro-batches of the step
on all data-parallel ranks), the step loss is
    token_mean: sum_i sum_t m_it x_it / N
    seq_mean:   sum_i (sum_t m_it x_it / sum_t m_it) / S      (a row without loss tokens adds 0)
Both are sums over rows, so summing the contributions of any partition of the rows gives the same loss and the
same gradients as the whole batch. Metrics are reduced the same way (token sums / N) so they add up too.
"""
from __future__ import annotations

from typing import Iterable

import torch

LOSS_AGGREGATIONS = ("token_mean", "seq_mean")


def aggregate(per_token: torch.Tensor, micro_batch: dict[str, torch.Tensor], how: str) -> torch.Tensor:
    """Contribution of `per_token` [b, T] to the step loss under aggregation `how`."""
    mask = micro_batch["loss_mask"]
    if how == "token_mean":
        return (per_token * mask).sum() / micro_batch["global_tokens"].clamp(min=1)
    if how == "seq_mean":
        per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_sequence.sum() / micro_batch["global_sequences"].clamp(min=1)
    raise ValueError(f"algorithm.loss_agg: must be one of {', '.join(LOSS_AGGREGATIONS)}; got {how!r}")


def token_metric(per_token: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Contribution of a per-token quantity to its step-wide token mean (detached, for metrics)."""
    mask = micro_batch["loss_mask"]
    return ((per_token.detach() * mask).sum() / micro_batch["global_tokens"].clamp(min=1)).detach()


def check_micro_batch(token_logprobs: torch.Tensor, micro_batch: dict[str, torch.Tensor],
                      keys: Iterable[str], *, algorithm: str) -> None:
    """Raise a ValueError naming what is missing or misshapen, before any arithmetic hides it."""
    missing = [k for k in keys if k not in micro_batch]
    if missing:
        raise ValueError(f"{algorithm} loss: micro-batch lacks {', '.join(missing)} "
                         f"(has {', '.join(sorted(micro_batch))})")
    shape = micro_batch["loss_mask"].shape
    if token_logprobs.shape != shape:
        raise ValueError(f"{algorithm} loss: token_logprobs has shape {tuple(token_logprobs.shape)}, "
                         f"loss_mask has {tuple(shape)}; they must match [b, T]")
