"""Sequence packing: one micro-batch's rows run as one concatenated sequence (`trainer.pack_sequences`).

A batch-contract micro-batch is right-padded, [b, T]. Packed, its real tokens (row i's first `row_lens[i]` input
positions, rows in order) form one [1, S] sequence, S = sum(row_lens), and megatron attends within each row only
through `PackedSeqParams` (qkv_format "thd", cu_seqlens = [0, len_0, len_0 + len_1, ...], int32): no compute is
spent on padding. Rotary positions restart at 0 in every row (Transformer Engine's fused RoPE reads cu_seqlens).
The logits come back as [1, S, V/tp] and are scattered into the padded [b, T, V/tp] layout (zeros at padding), so
log-probs, losses and metrics read the same micro-batch dict as without packing (padding positions have
loss_mask 0, so their zeros never reach a loss).

Only Transformer Engine's attention implements "thd" (megatron's local spec, the CPU path, does not), so
`packing_supported()` is False on a CPU machine and the trainer refuses the option there; this path has not run on
this project's CPU test machines. Not handled: context parallelism and sequence parallelism (they need each row's
length padded to a multiple of 2 x cp x tp: `cu_seqlens_*_padded`); pipeline parallelism (the config refuses it).
"""
from __future__ import annotations

import torch

from megatron_bridge.model import uses_transformer_engine


def packing_supported() -> bool:
    """True where megatron builds the Transformer Engine layer spec (TE importable and a GPU present)."""
    return uses_transformer_engine()


def packed_forward(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits [b, T, V/tp] of the padded micro-batch `mb` (needs `input_ids` [b, T] and `row_lens` [b]), computed
    as one packed sequence. A micro-batch without real tokens (an empty micro-batch of a token-budget plan) runs
    padded: there is nothing to pack."""
    from megatron.core.packed_seq_params import PackedSeqParams

    input_ids, lens = mb["input_ids"], mb["row_lens"].to(mb["input_ids"].device)
    if int(lens.sum()) == 0:
        return model(input_ids=input_ids, position_ids=mb["position_ids"], attention_mask=None)
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    real = positions < lens[:, None]  # [b, T], row-major order = rows concatenated
    row_lens = lens[lens > 0]
    cu_seqlens = torch.zeros(len(row_lens) + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = torch.cumsum(row_lens, 0)
    longest = int(row_lens.max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    logits = model(input_ids=input_ids[real][None], position_ids=positions[real][None], attention_mask=None,
                   packed_seq_params=params)  # [1, S, V/tp]
    out = logits.new_zeros(b, t, logits.shape[-1])
    return out.index_put(torch.nonzero(real, as_tuple=True), logits[0])
