"""Experience groups -> micro-batches, per the batch contract (docs/architecture.md, "The batch contract").

Every data-parallel rank builds the same global list of rows from the same groups and takes its own slice, so
the normalisers (`global_tokens`, `global_sequences`) are known everywhere without communication. All micro-batches
of a step have the same shape [micro_batch_size, T] (padding rows carry loss_mask 0) because the pipeline schedule
sends fixed-shape activations between stages.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rft.schema import ExperienceGroup


@dataclass
class Row:
    tokens: np.ndarray  # prompt + response, int64
    prompt_len: int
    loss_mask: np.ndarray  # over response tokens
    old_logprobs: np.ndarray  # over response tokens
    advantage: float


def rows_from_groups(groups: list[ExperienceGroup], advantages: list[np.ndarray], *, max_len: int | None = None) -> list[Row]:
    """One row per sample; `advantages[i][j]` belongs to sample j of group i. Sequences longer than `max_len`
    are cut at the end (the cut tokens leave the loss)."""
    rows = []
    for group, group_adv in zip(groups, advantages, strict=True):
        for sample, adv in zip(group.samples, group_adv, strict=True):
            tokens = np.concatenate([sample.prompt_tokens, sample.response_tokens]).astype(np.int64)
            mask = sample.loss_mask.astype(np.float32)
            logprobs = sample.logprobs.astype(np.float32)
            if max_len is not None and len(tokens) > max_len:
                keep = max(0, max_len - len(sample.prompt_tokens))
                tokens, mask, logprobs = tokens[:max_len], mask[:keep], logprobs[:keep]
            rows.append(Row(tokens, len(sample.prompt_tokens), mask, logprobs, float(adv)))
    return rows


def micro_batches_for_rank(rows: list[Row], *, dp_rank: int, dp_size: int, micro_batch_size: int,
                           pad_id: int = 0) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches. Rows are dealt round-robin over data-parallel ranks; every rank gets the same
    number of micro-batches of the same shape."""
    seq_len = max(len(r.tokens) for r in rows) - 1
    global_tokens = float(sum(r.loss_mask.sum() for r in rows))
    global_sequences = float(len(rows))
    per_rank = -(-len(rows) // dp_size)
    n_micro = max(1, -(-per_rank // micro_batch_size))
    mine = rows[dp_rank::dp_size]
    return [_pack(mine[i * micro_batch_size:(i + 1) * micro_batch_size], micro_batch_size, seq_len, pad_id,
                  global_tokens, global_sequences) for i in range(n_micro)]


def _pack(rows: list[Row], batch_size: int, seq_len: int, pad_id: int, global_tokens: float,
          global_sequences: float) -> dict[str, torch.Tensor]:
    input_ids = np.full((batch_size, seq_len), pad_id, dtype=np.int64)
    target_ids = np.full((batch_size, seq_len), pad_id, dtype=np.int64)
    loss_mask = np.zeros((batch_size, seq_len), dtype=np.float32)
    old_logprobs = np.zeros((batch_size, seq_len), dtype=np.float32)
    advantages = np.zeros(batch_size, dtype=np.float32)
    for i, row in enumerate(rows):
        n = len(row.tokens) - 1
        input_ids[i, :n], target_ids[i, :n] = row.tokens[:-1], row.tokens[1:]
        start = row.prompt_len - 1  # target index of the first response token
        r = len(row.loss_mask)
        loss_mask[i, start:start + r] = row.loss_mask
        old_logprobs[i, start:start + r] = row.old_logprobs
        advantages[i] = row.advantage
    return {
        "input_ids": torch.from_numpy(input_ids), "target_ids": torch.from_numpy(target_ids),
        "position_ids": torch.arange(seq_len, dtype=torch.int64).expand(batch_size, seq_len).contiguous(),
        "loss_mask": torch.from_numpy(loss_mask), "old_logprobs": torch.from_numpy(old_logprobs),
        "advantages": torch.from_numpy(advantages),
        "global_tokens": torch.tensor(global_tokens), "global_sequences": torch.tensor(global_sequences),
    }
