"""Token log-probabilities, entropies and full logits from vocabulary-parallel logits.

Under TP each rank's output layer produces logits for its slice of the (padded) vocabulary. The
padding columns (ids >= the HF vocab size) are not part of the model: they are set to -inf before
the softmax (or left out) so results equal those of the unpadded HF model exactly. `token_logprobs`
is differentiable (megatron's vocab-parallel cross entropy: one max and two sums all-reduced over the
TP group, never the full [b, T, V] tensor on one rank). `entropy_sum` is a metric (no gradient),
computed the same vocab-parallel way, in chunks of positions to bound its memory; `token_statistics` gives the
same entropy per position, and the collision term sum_v p_v^2 (log p_v + H) that Clip_V reads
(rft/algorithms/entropy_clip.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

ENTROPY_CHUNK_TOKENS = 1024  # positions per chunk in `entropy_sum`: bounds its copy to [chunk, V/tp] float32


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


def entropy_sum(logits_shard: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Sum over positions with loss_mask > 0 of the entropy -sum_v p_v log p_v of softmax(logits) (the
    padding columns left out): a float64 scalar, no gradient, the same on every TP rank.

    Vocabulary-parallel as verl's `vocab_parallel_entropy`: with s = logits - max (max all-reduced over
    the TP group) and Z = sum_v exp(s_v), H = log Z - sum_v exp(s_v) s_v / Z; both sums are one
    all-reduce. Works on `ENTROPY_CHUNK_TOKENS` selected positions at a time (AReaL chunks the same
    way), so the extra memory is [chunk, V/tp] whatever b * T is. Call it before `token_logprobs`,
    which overwrites `logits_shard`. Collective over the TP group: every TP rank holds the same mask.
    """
    width = logits_shard.shape[-1]
    real_width = max(0, min(width, vocab_size - _vocab_start(width)))
    with torch.no_grad():
        flat = logits_shard.reshape(-1, width)
        positions = torch.nonzero(loss_mask.reshape(-1) > 0).flatten().to(flat.device)
        total = torch.zeros((), dtype=torch.float64, device=flat.device)
        for start in range(0, len(positions), ENTROPY_CHUNK_TOKENS):
            logits = flat.index_select(0, positions[start:start + ENTROPY_CHUNK_TOKENS])[:, :real_width].float()
            total += _vocab_parallel_entropy(logits).double().sum()
    return total


def token_statistics(logits_shard: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int, *,
                     collision: bool = False) -> torch.Tensor:
    """Per position with loss_mask > 0, of softmax(logits) p (the padding columns left out): [2, b, T] float32, no
    gradient, the same on every TP rank; 0 at the other positions.
    [0]: the entropy H = -sum_v p_v log p_v;
    [1] (with `collision`, else 0): C = sum_v p_v^2 (log p_v + H), the covariance under p of p_v and log p_v (Clip_V's
    `nec`).
    Vocabulary-parallel as `entropy_sum` (one max and one sum all-reduced over the TP group), in chunks of
    `ENTROPY_CHUNK_TOKENS` positions. Call it before `token_logprobs`, which overwrites `logits_shard`."""
    width = logits_shard.shape[-1]
    real_width = max(0, min(width, vocab_size - _vocab_start(width)))
    with torch.no_grad():
        flat = logits_shard.reshape(-1, width)
        out = torch.zeros((2, flat.shape[0]), dtype=torch.float32, device=flat.device)
        positions = torch.nonzero(loss_mask.reshape(-1) > 0).flatten().to(flat.device)
        for start in range(0, len(positions), ENTROPY_CHUNK_TOKENS):
            chunk = positions[start:start + ENTROPY_CHUNK_TOKENS]
            logits = flat.index_select(0, chunk)[:, :real_width].float()
            entropy, coll = _vocab_parallel_statistics(logits, collision=collision)
            out[0, chunk] = entropy
            if coll is not None:
                out[1, chunk] = coll
    return out.reshape(2, *logits_shard.shape[:-1])


def _vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy per row [n] of [n, V/tp] logit shards (this rank's real columns only)."""
    return _vocab_parallel_statistics(logits, collision=False)[0]


def _vocab_parallel_statistics(logits: torch.Tensor, *, collision: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(entropy [n], collision term [n] or None) per row of [n, V/tp] logit shards (this rank's real columns only).
    With s = logits - max and e = exp(s): Z = sum e, W = sum e s, and (collision) Q = sum e^2, R = sum e^2 s, summed
    over the TP group in one all-reduce; H = log Z - W / Z and sum_v p_v^2 (log p_v + H) = (R - Q W / Z) / Z^2."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    sharded = parallel_state.get_tensor_model_parallel_world_size() > 1
    if logits.shape[-1]:
        row_max = logits.max(-1).values
    else:  # every column of this shard is vocabulary padding
        row_max = torch.full(logits.shape[:1], float("-inf"), device=logits.device)
    if sharded:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - row_max[:, None]
    exp = shifted.exp()
    terms = [exp.sum(-1), (exp * shifted).sum(-1)]
    if collision:
        square = exp * exp
        terms += [square.sum(-1), (square * shifted).sum(-1)]
    sums = torch.stack(terms)
    if sharded:
        dist.all_reduce(sums, group=group)
    partition, weighted = sums[0], sums[1]
    entropy = partition.log() - weighted / partition
    if not collision:
        return entropy, None
    squares, weighted_squares = sums[2], sums[3]
    return entropy, (weighted_squares - squares * weighted / partition) / partition.square()
