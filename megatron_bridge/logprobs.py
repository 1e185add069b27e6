"""Token log-probabilities and full logits from vocabulary-parallel logits.

Under TP each rank's output layer produces logits for its slice of the (padded) vocabulary. The
padding columns (ids >= the HF vocab size) are not part of the model: they are set to -inf before
the softmax so log-probs equal those of the unpadded HF model exactly. `token_logprobs` is
differentiable (megatron's vocab-parallel cross entropy: one max and two sums all-reduced over the
TP group, never the full [b, T, V] tensor on one rank).
"""
from __future__ import annotations

import torch


def _vocab_start(shard_width: int) -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() * shard_width


def mask_vocab_padding_(logits_shard: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set this rank's padded-vocabulary columns to -inf, in place; returns `logits_shard`."""
    width = logits_shard.shape[-1]
    first_pad = vocab_size - _vocab_start(width)
    if first_pad < width:
        column = torch.arange(width, device=logits_shard.device)
        logits_shard.masked_fill_(column >= first_pad, float("-inf"))
    return logits_shard


def token_logprobs(logits_shard: torch.Tensor, target_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log softmax(logits)[target] for every position: [b, T] float32, from [b, T, V/tp] shards.

    Consumes `logits_shard`: the padding mask and megatron's cross entropy overwrite it in place (as
    megatron itself does with the output layer's result), to avoid another [b, T, V/tp] copy.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if target_ids.min() < 0 or target_ids.max() >= vocab_size:
        raise ValueError(f"target_ids must lie in [0, {vocab_size}), got range "
                         f"[{int(target_ids.min())}, {int(target_ids.max())}]")
    return -vocab_parallel_cross_entropy(mask_vocab_padding_(logits_shard, vocab_size), target_ids)


def gather_logits(logits_shard: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The full [b, T, vocab_size] logits on every TP rank (padding columns dropped). Not for autograd."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    with torch.no_grad():
        return gather_from_tensor_model_parallel_region(logits_shard)[..., :vocab_size]
