"""Shared prompts: the rows of a micro-batch that start with the same prompt run it once (`trainer.share_prompts`).

A GRPO group is n samples of one prompt, so a micro-batch of one group holds the prompt n times. Here a
micro-batch's rows run as one sequence [1, S] laid out group by group:

    prompt of group g (positions 0..p-1) | row a's response inputs (p..n_a-1) | row b's (p..n_b-1) | ... | group g+1

(`row_lens`: a row's input positions; `prompt_lens` [b]: where its response starts). Attention is masked so each
token sees exactly what it saw in its own row, and rotary positions are each token's position in its row, so every
hidden state is the row's own (up to float rounding) and a shared prompt position's gradient is the sum of its
rows': the step is the padded step's, on fewer positions (docs/benchmarks.md).
The output layer runs only from position p - 1 to n_i - 1; the logits are scattered into the cut layout [b, T -
first, V/tp] that `schedule.run` hands `on_logits` (`head_from_loss`), zeros elsewhere (loss_mask 0 there).

Where it applies (`applies`): megatron's local layer spec (an explicit [S, S] mask; with Transformer Engine use
`pack_sequences`), rotary embeddings, a dense model, one pipeline stage, no sequence parallelism, no routing replay.
A micro-batch in which no two rows share a prompt runs padded.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_bridge.model import unwrap, uses_transformer_engine


@dataclass
class Layout:
    """One micro-batch's shared layout. `input_ids`, `positions` [1, S]; `blocked` [1, 1, S, S] bool (True: may not
    attend, megatron's mask convention); `heads` [N]: the packed index of each logit the output layer computes, for
    row `rows` [N] at cut column `columns` [N]."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    blocked: torch.Tensor
    heads: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor


@dataclass(frozen=True)
class Costs:
    """A model's training FLOPs per position (its parameters' matrix products) and per attended (query, key) pair
    (scores and weighted values over every layer): what `layout` weighs the shared sequence against the padded rows
    with, on this rank (its parameter shards and attention heads). Forward and backward scale both alike, so the
    forward's count decides."""
    per_position: float
    per_pair: float

    @classmethod
    def of(cls, model: torch.nn.Module) -> Costs:
        config = unwrap(model).config
        parameters = sum(p.numel() for p in model.parameters())
        return cls(per_position=2.0 * parameters,
                   per_pair=4.0 * config.kv_channels * config.num_layers
                   * (config.num_attention_heads // config.tensor_model_parallel_size))


def layout(mb: dict[str, torch.Tensor], first: int, costs: Costs) -> Layout | None:
    """The shared layout of `mb` (needs `input_ids` [b, T], `row_lens` [b], `prompt_lens` [b]) with the output layer
    from cut column `first` on; None when no two rows share a prompt, or when the shared sequence would cost more than
    the padded rows: its attention is over the whole sequence, so rows whose responses are much longer than their
    prompt are cheaper padded (8 rows of a 100-token prompt and 4,000-token responses: ~8x the attention)."""
    ids = mb["input_ids"].cpu()
    lens = mb["row_lens"].cpu().tolist()
    prompts = [min(p, n) for p, n in zip(mb["prompt_lens"].cpu().tolist(), lens, strict=True)]
    groups: dict[tuple, list[int]] = {}
    for i, (n, p) in enumerate(zip(lens, prompts, strict=True)):
        if n > 0:
            groups.setdefault((p, *ids[i, :p].tolist()), []).append(i)
    if all(len(rows) < 2 for rows in groups.values()):
        return None
    shared = sum(prompts[rows[0]] + sum(lens[i] - prompts[i] for i in rows) for rows in groups.values())
    real, width = sum(n > 0 for n in lens), ids.shape[1]  # the padded rows that hold tokens, and their width
    if (shared * costs.per_position + shared ** 2 * costs.per_pair
            >= real * width * costs.per_position + real * width ** 2 * costs.per_pair):
        return None
    tokens: list[int] = []
    positions: list[int] = []
    segment: list[int] = []  # the group's number
    owner: list[int] = []  # the row, -1 for a prompt
    packed_at: dict[tuple[int, int], int] = {}  # (row, input position) -> packed index
    for g, members in enumerate(groups.values()):
        p = prompts[members[0]]
        start = len(tokens)
        tokens += ids[members[0], :p].tolist()
        positions += range(p)
        segment += [g] * p
        owner += [-1] * p
        for i in members:
            packed_at.update({(i, c): start + c for c in range(p)})
            packed_at.update({(i, c): len(tokens) + c - p for c in range(p, lens[i])})
            tokens += ids[i, p:lens[i]].tolist()
            positions += range(p, lens[i])
            segment += [g] * (lens[i] - p)
            owner += [i] * (lens[i] - p)
    seg, own, pos = torch.tensor(segment), torch.tensor(owner), torch.tensor(positions)
    sees = ((seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
            & ((own[None, :] == -1) | (own[None, :] == own[:, None])))  # [query, key]
    heads, rows, columns = [], [], []
    for i, (n, p) in enumerate(zip(lens, prompts, strict=True)):
        for c in range(max(first, p - 1, 0), n):
            heads.append(packed_at[(i, c)])
            rows.append(i)
            columns.append(c - first)
    device = mb["input_ids"].device

    def as_long(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return Layout(as_long([tokens]), pos[None].to(device), (~sees)[None, None].to(device),
                  as_long(heads), as_long(rows), as_long(columns))


def forward(model: torch.nn.Module, mb: dict[str, torch.Tensor], plan: Layout, first: int) -> torch.Tensor:
    """Logits [b, T - first, V/tp] of `mb`'s rows from one shared forward of `plan` (zeros where no logit was
    computed). `model` is one model chunk (under any wrappers) with the rotary embedding and output layer."""
    core = unwrap(model)
    hooks = [core.rotary_pos_emb.register_forward_hook(lambda module, args, table: table[plan.positions[0]]),
             core.output_layer.register_forward_pre_hook(lambda module, args: (args[0][plan.heads], *args[1:]))]
    try:
        logits = model(input_ids=plan.input_ids, position_ids=plan.positions, attention_mask=plan.blocked)  # [1, N, V]
    finally:
        for hook in hooks:
            hook.remove()
    b, t = mb["input_ids"].shape
    out = logits.new_zeros(b, t - first, logits.shape[-1])
    return out.index_put((plan.rows, plan.columns), logits[0])


def applies(model: torch.nn.Module) -> str | None:
    """None when `model` (a chunk, under any wrappers) can run shared prompts; else why not, in a few words."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    core = unwrap(model)
    config = core.config
    if uses_transformer_engine():
        return "Transformer Engine's attention (use trainer.pack_sequences)"
    if config.pipeline_model_parallel_size > 1:
        return "pipeline stages"
    if config.sequence_parallel or config.context_parallel_size > 1:
        return "sequence or context parallelism"
    if config.num_moe_experts:
        return "a mixture of experts"
    if config.masked_softmax_fusion and (config.fp16 or config.bf16):
        return "megatron's fused causal softmax, which ignores an explicit mask"
    if not isinstance(getattr(core, "rotary_pos_emb", None), RotaryEmbedding) or \
            getattr(core, "position_embedding_type", None) != "rope":
        return "a position embedding other than rotary"
    if core.bridge_info.bridge.first_stage_prefixes:
        return "a vision-language model"
    if not (getattr(core, "pre_process", False) and getattr(core, "post_process", False)):
        return "a model split into stages"
    return None
