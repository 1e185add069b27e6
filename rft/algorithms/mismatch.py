"""The training-inference log-probability mismatch: how far the trainer's log-probs of the sampled tokens are from
those the inference engine reported while sampling them (the records' behaviour log-probs, `old_logprobs`).

With d_t = |log p_trainer(y_t) - log p_rollout(y_t)| over the step's response tokens that enter the loss
(loss_mask > 0, demonstration rows left out: their recorded log-probs are not an engine's):
    logprob_mismatch_mean = sum_t d_t / N    (N: those tokens over the whole step, all data-parallel ranks)
    logprob_mismatch_max  = max_t d_t        (0 when the step has no such token)
Both are computed per micro-batch in the training forward (the weights the step starts from), so they measure
what the engine and the trainer disagree on: numerics (dtype, kernels), MoE routing (a token routed to other experts;
`trainer.routing_replay` removes that part), and staleness (records of an older policy version).

Reduction contract (megatron_bridge.policy's `train_step`): a metric named `*_max` is reduced by max over
micro-batches and data-parallel ranks, every other by sum; `*_mean` is emitted as each micro-batch's share of the
step mean (its token sum / N), so the sum of shares is the step mean. `logprob_mismatch` is the one function that
computes both for any subset of tokens: a later split (e.g. by staleness, or a KL estimate beside it) calls it again
with its own mask, normaliser and prefix.
"""
from __future__ import annotations

from typing import Callable

import torch

LossFn = Callable[[torch.Tensor, dict], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]

PREFIX = "logprob_mismatch"


def logprob_mismatch(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                     normaliser: torch.Tensor | float, prefix: str = PREFIX) -> dict[str, torch.Tensor]:
    """`{prefix}_mean`: this micro-batch's share sum(|trainer - rollout| over `mask`) / `normaliser` of the step
    mean, and `{prefix}_max`: the largest |trainer - rollout| over `mask` (0.0 where `mask` selects nothing).

    Arguments are [b, T] tensors aligned on target positions (natural-log probabilities, float); `mask` is
    boolean or 0/1; `normaliser` is the number of selected tokens over the whole step (clamped to >= 1). Detached
    float64 scalars: metrics, no gradient."""
    if trainer_logprobs.shape != rollout_logprobs.shape or trainer_logprobs.shape != mask.shape:
        raise ValueError(f"logprob_mismatch: trainer {tuple(trainer_logprobs.shape)}, rollout "
                         f"{tuple(rollout_logprobs.shape)} and mask {tuple(mask.shape)} must have one [b, T] shape")
    with torch.no_grad():
        selected = mask > 0
        gap = (trainer_logprobs.detach().double() - rollout_logprobs.double()).abs()
        gap = torch.where(selected, gap, torch.zeros_like(gap))  # padding may hold anything, even inf
        normaliser = torch.as_tensor(normaliser, dtype=torch.float64, device=gap.device).clamp(min=1)
        return {f"{prefix}_mean": gap.sum() / normaliser,
                f"{prefix}_max": gap.max()}


def with_mismatch_metrics(loss_fn: LossFn) -> LossFn:
    """`loss_fn` that also reports `logprob_mismatch_mean` / `_max` (module docstring) from the micro-batch's
    `old_logprobs` and `loss_mask`, leaving out demonstration rows (`demo_mask`) and their tokens
    (`global_demo_tokens`)."""
    def loss_with_mismatch(token_logprobs: torch.Tensor, micro_batch: dict[str, torch.Tensor]):
        loss, metrics = loss_fn(token_logprobs, micro_batch)
        mask = micro_batch["loss_mask"] > 0
        normaliser = micro_batch["global_tokens"]
        if "demo_mask" in micro_batch:
            mask = mask & (micro_batch["demo_mask"][:, None] == 0)
            normaliser = normaliser - micro_batch.get("global_demo_tokens", 0.0)
        return loss, {**metrics, **logprob_mismatch(token_logprobs, micro_batch["old_logprobs"], mask,
                                                    normaliser=normaliser)}
    return loss_with_mismatch
