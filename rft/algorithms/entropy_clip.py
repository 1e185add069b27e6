"""Clip_B and Clip_V (Trinity-RFT's entropy example, "On the Entropy Dynamics in Reinforcement Fine-Tuning of Large
Language Models", arXiv 2602.03392): GRPO, with some negative-advantage tokens taken out of the loss by how much
they would change the policy's entropy, so that negative samples do not collapse it.

Per loss token t of the step, at the weights the step starts from (`Needs.step_start`): p_t = exp(logp_t) of the
sampled token, H_t the entropy of the (tempered) distribution, C_t = sum_v p_v^2 (log p_v + H_t) over the vocabulary.
    S_t = p_t (H_t + logp_t)       (the sampled token's first-order effect on the entropy)
    clip_b:  x_t = S_t;  with m, s the mean and population std of x over all loss tokens of the step (every
             data-parallel rank), a token with A_i < 0 and x_t - m < -mu s is dropped (mu = entropy_clip_mu, 2.5)
    clip_v:  x_t = C_t - S_t (not centred: its expectation under p is 0); a token with A_i < 0 and x_t > mu s is a
             candidate (mu 8.5); when the candidates are more than entropy_clip_max_frac (1e-4) of the loss tokens,
             only the K = max(floor(max_frac N), 1) largest x_t are dropped (a global bisection on the threshold,
             rft/algorithms/whole_batch.py; tied values go together, so fewer than K may be dropped at a tie)
Positive- and zero-advantage tokens are always kept; nothing is dropped when s < 1e-12. Dropped tokens leave
`loss_mask`, and the step's token counts (`global_tokens`, `staleness_tokens`) are recounted, as Trinity-RFT drops
them from response_mask: the loss is GRPO's over the kept tokens (token_mean divides by their number), and the step's
token metrics (kl, entropy, mismatch) are over them too.
Advantages are GRPO's (group-normalised, std + 1e-6); every GRPO key applies. One difference from Trinity-RFT: its
Clip_B reads the engine's log-probs of the sampled tokens (`rollout_log_probs`) with the trainer's entropy, while its
own comment and Clip_V use the trainer's recomputed ones; rft uses the log-probs at the step's start for both (the
same on-policy, up to the training-inference mismatch). Metrics, per step: `entropy_clip_frac` (dropped / loss
tokens), `entropy_clip_neg_frac` (dropped / negative-advantage loss tokens), `entropy_clip_signal_mean` and
`entropy_clip_signal_std` (m and s of x).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rft.algorithms.grpo import GRPO, GRPOOptions
from rft.algorithms.registry import MicroBatch, StepStart, register
from rft.algorithms.whole_batch import (
    SumOverReplicas,
    flat_values,
    global_sums,
    largest_true,
    mean_and_std,
    replace_loss_masks,
)
from rft.config import POSITIVE, Range, option
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")

MIN_STD = 1e-12  # below it the signal is constant: nothing is dropped


@dataclass(frozen=True)
class ClipBOptions(GRPOOptions):
    """GRPO's keys and the clipping width."""
    entropy_clip_mu: float = option(2.5, range=POSITIVE,
        help="clip_b: a negative-advantage token whose p (H + log p) is below the step's mean by more than mu "
        "standard deviations leaves the loss")


@dataclass(frozen=True)
class ClipVOptions(GRPOOptions):
    """GRPO's keys, the clipping width and the cap on the share of tokens clipped."""
    entropy_clip_mu: float = option(8.5, range=POSITIVE,
        help="clip_v: a negative-advantage token whose sum_v p_v^2 (log p_v + H) - p (H + log p) exceeds mu "
        "standard deviations leaves the loss (within entropy_clip_max_frac)")
    entropy_clip_max_frac: float = option(1e-4, range=Range(0, 1, low_open=True),
        help="clip_v: at most this share of the step's loss tokens is clipped (the largest signals; at least one)")


def signal_parts(micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(S [b, T], loss mask [b, T] bool) of the module docstring from `start_logprobs` and `start_entropy`."""
    mask = micro_batch["loss_mask"] > 0
    logp = torch.where(mask, micro_batch["start_logprobs"].float(), 0.0)
    return torch.where(mask, logp.exp() * (micro_batch["start_entropy"].float() + logp), 0.0), mask


class EntropyClip(GRPO):
    """The common part: the pass before the step, the step-wide moments, the new loss masks and the metrics;
    subclasses give the signal x and the tokens to drop."""
    collision = False  # whether the signal needs C_t (start_collision)

    def __init__(self, options: GRPOOptions):
        super().__init__(options)
        self.needs = dataclasses.replace(self.needs, step_start=StepStart(
            prepare=self.prepare, entropy=True, collision=self.collision))
        self._step: dict[str, float] = {}

    def signal(self, micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(x [b, T], loss mask [b, T] bool)."""
        raise NotImplementedError

    def dropped(self, signals: list[torch.Tensor], negatives: list[torch.Tensor], mean: float, std: float,
                count: float, sum_over_replicas: SumOverReplicas) -> list[torch.Tensor]:
        """Per micro-batch, the tokens [b, T] bool to drop, among `negatives` (negative-advantage loss tokens)."""
        raise NotImplementedError

    def prepare(self, micro_batches: list[MicroBatch], sum_over_replicas: SumOverReplicas) -> list[MicroBatch]:
        """The micro-batches with the dropped tokens out of `loss_mask` and the step's token counts recounted."""
        parts = [self.signal(mb) for mb in micro_batches]
        signals, masks = [x for x, _ in parts], [m for _, m in parts]
        count, mean, std = mean_and_std(flat_values(signals, masks), sum_over_replicas)
        negatives = [m & (mb["advantages"].float()[:, None] < 0) for mb, m in zip(micro_batches, masks, strict=True)]
        drops = ([torch.zeros_like(m) for m in masks] if std < MIN_STD
                 else self.dropped(signals, negatives, mean, std, count, sum_over_replicas))
        dropped, negative = global_sums([sum(float(d.sum()) for d in drops), sum(float(n.sum()) for n in negatives)],
                                        sum_over_replicas)
        self._step = {"entropy_clip_frac": dropped / count if count else 0.0,
                      "entropy_clip_neg_frac": dropped / negative if negative else 0.0,
                      "entropy_clip_signal_mean": mean, "entropy_clip_signal_std": std}
        return replace_loss_masks(micro_batches, [m & ~d for m, d in zip(masks, drops, strict=True)],
                                  sum_over_replicas)

    def step_metrics(self, step: int) -> dict[str, float]:
        return dict(self._step)


@register("clip_b", options=ClipBOptions)
class ClipB(EntropyClip):
    cfg: ClipBOptions

    def signal(self, micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return signal_parts(micro_batch)

    def dropped(self, signals, negatives, mean, std, count, sum_over_replicas):
        bound = -self.cfg.entropy_clip_mu * std
        return [n & (x.double() - mean < bound) for x, n in zip(signals, negatives, strict=True)]


@register("clip_v", options=ClipVOptions)
class ClipV(EntropyClip):
    cfg: ClipVOptions
    collision = True

    def signal(self, micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        entropy_term, mask = signal_parts(micro_batch)
        return torch.where(mask, micro_batch["start_collision"].float() - entropy_term, 0.0), mask

    def dropped(self, signals, negatives, mean, std, count, sum_over_replicas):
        bound = self.cfg.entropy_clip_mu * std
        candidates = [n & (x.double() > bound) for x, n in zip(signals, negatives, strict=True)]
        (total,) = global_sums([sum(float(c.sum()) for c in candidates)], sum_over_replicas)
        limit = max(int(self.cfg.entropy_clip_max_frac * count), 1)
        if total <= self.cfg.entropy_clip_max_frac * count or total <= limit:
            return candidates
        values = flat_values(signals, candidates)

        def too_many(c: float) -> bool:  # more than `limit` candidates at or above c
            (above,) = global_sums([(values >= c).sum()], sum_over_replicas)
            return above > limit
        cutoff = largest_true(too_many)  # finite (too_many(0) holds); at most `limit` candidates are above it
        return [c & (x > cutoff) for x, c in zip(signals, candidates, strict=True)]
