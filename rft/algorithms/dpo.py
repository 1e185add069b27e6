"""DPO (Rafailov et al. 2023): preference pairs against a frozen reference model.

Rows come in pairs: `pair_index` names the pair, `pair_chosen` marks the preferred row; rows with
pair_index < 0 are padding. With the sequence log-ratio z = sum_t m_t (logp_t - ref_t) of each row,
    loss_pair = -log sigmoid(dpo_beta * (z_chosen - z_rejected))
and the step loss is the mean over pairs: each micro-batch adds sum(loss_pair) / (global_sequences / 2).
Both rows of a pair must be in the same micro-batch (a ValueError says which pair is not). `loss_agg` does not
apply: the objective is per pair. Metrics: `dpo_accuracy` (pairs with a positive margin), `dpo_margin` (mean of
dpo_beta * (z_chosen - z_rejected)). Needs `ref_logprobs`; uses recorded pairs only, so it runs in replay.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rft.algorithms.aggregation import check_micro_batch
from rft.algorithms.registry import Algorithm, Metrics, MicroBatch, Needs, register, zero_advantages
from rft.config import FINITE, Section, option
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:  # imported by the first loss, not by a config check (rft/lazy.py)
    torch, F = lazy("torch"), lazy("torch.nn.functional")


@dataclass(frozen=True)
class DPOOptions(Section):
    KEY = "algorithm"
    dpo_beta: float = option(0.1, range=FINITE,
        help="the inverse temperature of the preference margin (the strength of the pull away from the reference)")


@register("dpo", options=DPOOptions)
class DPO(Algorithm):
    # the frozen reference, and pair rows: one group = one pair (rft/trainer/batch.py)
    needs = Needs(reference=True, pairwise=True)
    supports_replay = True
    advantages = staticmethod(zero_advantages)

    def __init__(self, options: DPOOptions):
        self.cfg = options

    def loss_fn(self, token_logprobs: torch.Tensor, micro_batch: MicroBatch) -> tuple[torch.Tensor, Metrics]:
        check_micro_batch(token_logprobs, micro_batch, ["loss_mask", "ref_logprobs", "pair_chosen", "pair_index",
                                                        "global_sequences"], algorithm=self.name)
        log_ratio = (token_logprobs.float() - micro_batch["ref_logprobs"]) * micro_batch["loss_mask"]
        margin = self.cfg.dpo_beta * chosen_minus_rejected(log_ratio.sum(-1), micro_batch)
        n_pairs = micro_batch["global_sequences"].clamp(min=2) / 2
        metrics = {"dpo_accuracy": (margin > 0).float().sum().detach() / n_pairs,
                   "dpo_margin": margin.detach().sum() / n_pairs}
        return -F.logsigmoid(margin).sum() / n_pairs, metrics


def chosen_minus_rejected(per_row: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One value per pair in the micro-batch: per_row[chosen] - per_row[rejected]."""
    real = micro_batch["pair_index"] >= 0
    pair_ids, slot = torch.unique(micro_batch["pair_index"][real], return_inverse=True)
    chosen = micro_batch["pair_chosen"][real].float()
    rows = torch.bincount(slot, minlength=len(pair_ids))
    chosen_rows = torch.zeros(len(pair_ids), device=chosen.device).index_add(0, slot, chosen)
    bad = pair_ids[(rows != 2) | (chosen_rows != 1)]
    if len(bad):
        raise ValueError(f"dpo loss: pairs {bad.tolist()} do not have exactly one chosen and one rejected row in "
                         f"this micro-batch (keep both rows of a pair in the same micro-batch)")
    signed = torch.where(chosen > 0, per_row[real], -per_row[real])
    return torch.zeros(len(pair_ids), dtype=per_row.dtype, device=per_row.device).index_add(0, slot, signed)
