"""Per-token values -> one micro-batch's contribution to the optimizer step's loss (the batch contract).

With m the loss mask, N = `global_tokens` and S = `global_sequences` (counted over all micro-batches of the step
on all data-parallel ranks), the step loss is
    token_mean: sum_i sum_t m_it x_it / N
    seq_mean:   sum_i (sum_t m_it x_it / sum_t m_it) / S      (a row without loss tokens adds 0)
Both are sums over rows, so summing the contributions of any partition of the rows gives the same loss and the
same gradients as the whole batch. Metrics are reduced the same way (token sums / N) so they add up too.

KL estimates use Schulman's k3 estimator (http://joschu.net/blog/kl-approx.html): for tokens sampled from p and
x = log q - log p at each, k3 = exp(x) - x - 1 >= 0 has expectation KL(p || q). `with_kl_metric` makes every
algorithm report a `kl` metric: the algorithm's own (e.g. GRPO's KL to the reference model when kl_coef > 0), or,
when it reports none, the k3 estimate of KL(behaviour || current) over loss tokens, where the behaviour policy
(`old_logprobs`, the weights the explorer sampled with) is the one the tokens were drawn from.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")


LossFn = Callable[["torch.Tensor", dict], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]

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


def k3(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate exp(x) - x - 1 of KL(p || q) with x = `log_ratio` = log q - log p at tokens drawn
    from p; 0 where `mask` is False (x is zeroed there before the exponential, so padding cannot overflow)."""
    x = torch.where(mask, log_ratio, 0.0)
    return torch.exp(x) - x - 1


def behaviour_kl(token_logprobs: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Contribution to the step-wide token mean of k3 KL(behaviour || current): tokens were drawn from the
    behaviour policy (`old_logprobs`), so x = logp_current - logp_behaviour. Detached (a metric)."""
    mask = micro_batch["loss_mask"] > 0
    return token_metric(k3(token_logprobs.detach().float() - micro_batch["old_logprobs"], mask), micro_batch)


def with_kl_metric(loss_fn: LossFn) -> LossFn:
    """`loss_fn` that always reports `kl`: its own when it has one, else `behaviour_kl` (needs `old_logprobs`
    in every micro-batch, as the batch contract guarantees)."""
    def loss_with_kl(token_logprobs: torch.Tensor, micro_batch: dict[str, torch.Tensor]):
        loss, metrics = loss_fn(token_logprobs, micro_batch)
        if "kl" not in metrics:
            check_micro_batch(token_logprobs, micro_batch, ["loss_mask", "old_logprobs", "global_tokens"],
                              algorithm="kl metric")
            metrics = {**metrics, "kl": behaviour_kl(token_logprobs, micro_batch)}
        return loss, metrics
    return loss_with_kl


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
