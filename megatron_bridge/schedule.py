"""Megatron's pipeline schedule (`get_forward_backward_func()`) over batch-contract micro-batches.

Every rank of a model replica (all its TP and PP ranks) passes the same list of micro-batches; the first stage
embeds `input_ids`, the last stage turns its vocabulary-parallel logits into results. `run(...)` returns, on the
last pipeline stage, one result per micro-batch in order; on other stages an empty list.

position_ids must be 0..T-1 (right-padded rows: megatron's rotary embedding ignores them); `check_micro_batch`
refuses anything else. Micro-batches may differ in shape [b_i, T_i] with one pipeline stage; with `packed` each runs
as one packed sequence (megatron_bridge.packing) and `on_logits` still sees the padded [b, T, V/tp] layout.
With sequence parallelism (turned on for MoE at TP > 1) each micro-batch is right-padded to a multiple of TP and the
logits cut back to T before `on_logits`. A vision-language model's forward gets the micro-batch's image tensors (the
keys of its bridge's `image_keys` the micro-batch has, collated by the bridge's `collate_images`) and its
`prompt_lens` [b] when it has them (the model reads image placeholders only inside each row's prompt:
megatron_bridge.vision); a text model's gets neither; packing and shared prompts refuse images.

With `head_from_loss`, the output layer runs only from each micro-batch's first position with `loss_mask` > 0 to its
end (earlier positions still feed later ones through attention, so the logits produced are the full forward's):
`on_logits` then sees logits [b, T - first, V/tp] and the micro-batch cut the same way (`cut_positions`), with
`head_from` = first. The training step uses it; forward-only log-probs keep every position. Not with packing or
sequence parallelism.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

import megatron_bridge.device as device
import megatron_bridge.packing as packing
import megatron_bridge.shared_prompts as shared_prompts
from megatron_bridge.model import config_of, unwrap

REQUIRED_KEYS = ("input_ids", "position_ids")


def check_micro_batch(mb: dict[str, torch.Tensor], index: int) -> None:
    """Raise ValueError naming the key when a micro-batch breaks the contract the model relies on."""
    for key in REQUIRED_KEYS:
        if key not in mb:
            raise ValueError(f"micro-batch {index}: missing {key!r} (has {sorted(mb)})")
    ids, pos = mb["input_ids"], mb["position_ids"]
    if ids.dim() != 2 or ids.dtype != torch.int64:
        raise ValueError(f"micro-batch {index}: input_ids must be int64 [b, T], got {ids.dtype} {tuple(ids.shape)}")
    expected = torch.arange(ids.shape[1], device=pos.device).expand_as(ids)
    if pos.shape != ids.shape or not torch.equal(pos, expected):
        raise ValueError(f"micro-batch {index}: position_ids must be 0..T-1 on every row "
                         "(right padding, no packing): megatron's rotary embedding ignores them")


def to_compute_device(mb: dict[str, Any]) -> dict[str, Any]:
    target = device.compute_device()
    return {k: v.to(target, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}


def run(models: list[torch.nn.Module], micro_batches: list[dict[str, torch.Tensor]],
        on_logits: Callable[[torch.Tensor, dict], Any], *, forward_only: bool, packed: bool = False,
        before_forward: Callable[[torch.nn.Module, dict], None] | None = None,
        head_from_loss: bool = False, share_prompts: bool = False) -> list[Any]:
    """Run the schedule; `on_logits(logits_shard [b, T, V/tp], micro_batch)` runs on the last stage.

    Training (`forward_only=False`): `on_logits` returns `(loss, metrics)`; backward runs on `loss`
    unscaled (megatron's per-token-loss mode: no division by micro-batch count, DDP sums instead of
    averaging). Returns the list of `metrics` dicts. Forward only: returns `on_logits`'s results. `packed`: run each
    micro-batch as one packed sequence (needs `row_lens`; Transformer Engine only, see megatron_bridge.packing).
    `before_forward(model_chunk, micro_batch)` runs right before each chunk's forward on a micro-batch (routing
    replay sets the micro-batch's routed experts there: pipeline schedules interleave micro-batches).
    `head_from_loss`: the LM head only from each micro-batch's first loss position (module docstring; ignored with
    `packed` or sequence parallelism). `share_prompts` (with `head_from_loss`; the caller has checked
    `shared_prompts.applies`): a micro-batch with `prompt_lens` whose rows share a prompt runs it once
    (megatron_bridge.shared_prompts); `on_logits` sees the same cut layout. Not with routing replay (`routed_experts`).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("no micro-batches")
    for i, mb in enumerate(micro_batches):
        check_micro_batch(mb, i)

    multiple = _sequence_multiple(models)
    if packed and multiple > 1:
        raise ValueError("packed sequences with sequence parallelism (a mixture of experts at TP > 1) are not "
                         "supported")

    cut = head_from_loss and not packed and multiple == 1
    costs = shared_prompts.Costs.of(models[0]) if cut and share_prompts else None
    start = {"at": 0}  # the micro-batch in forward's first loss position, read by the output layers' hook
    hooks = [layer.register_forward_pre_hook(partial(_from_position, start)) for layer in output_layers(models)
             ] if cut else []

    def loss_func(mb, first, output_tensor, non_loss_data=False):
        output_tensor = output_tensor[:, :mb["input_ids"].shape[1]].contiguous()  # drop sequence-parallel padding
        if first:
            mb = cut_positions(mb, first)
        if forward_only:
            return on_logits(output_tensor, mb)
        loss, metrics = on_logits(output_tensor, mb)
        return loss, torch.ones((), dtype=torch.int), metrics

    def forward_step(data_iterator, model):
        mb = to_compute_device(next(data_iterator))
        if before_forward is not None:
            before_forward(model, mb)
        image_keys = unwrap(model).bridge_info.bridge.image_keys
        images = {k: mb[k] for k in image_keys if mb.get(k) is not None}
        if (packed or costs is not None) and images:
            raise ValueError(f"packed sequences and shared prompts do not take images (this vision-language model's "
                             f"micro-batch has {sorted(images)})")
        if packed:
            return packing.packed_forward(model, mb), partial(loss_func, mb, 0)
        start["at"] = first = first_loss_position(mb) if cut else 0
        if costs is not None and "prompt_lens" in mb and "routed_experts" not in mb:
            plan = shared_prompts.layout(mb, first, costs)
            if plan is not None:
                start["at"] = 0  # the shared forward picks the output layer's positions itself
                return shared_prompts.forward(model, mb, plan, first), partial(loss_func, mb, first)
        ids, positions = _right_pad(mb["input_ids"], multiple), _right_pad(mb["position_ids"], multiple, positions=True)
        prompts = {"prompt_lens": mb["prompt_lens"]} if image_keys and "prompt_lens" in mb else {}
        logits = model(input_ids=ids, position_ids=positions, attention_mask=None, **images, **prompts)
        return logits, partial(loss_func, mb, first)

    longest = max(mb["input_ids"].shape[1] for mb in micro_batches)
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=models,
            num_microbatches=len(micro_batches), seq_length=-(-longest // multiple) * multiple,
            micro_batch_size=max(mb["input_ids"].shape[0] for mb in micro_batches), forward_only=forward_only,
            collect_non_loss_data=forward_only)
    finally:
        for hook in hooks:
            hook.remove()


def first_loss_position(mb: dict[str, torch.Tensor]) -> int:
    """The first position (column) where any row of `mb` has `loss_mask` > 0; 0 when there is none or no mask."""
    mask = mb.get("loss_mask")
    if mask is None:
        return 0
    columns = torch.nonzero(mask.reshape(mask.shape[0], -1).gt(0).any(0))
    return int(columns[0]) if len(columns) else 0


def cut_positions(mb: dict[str, Any], first: int) -> dict[str, Any]:
    """`mb` from position `first` on: every tensor laid out [b, T, ...] cut to [b, T - first, ...] (others as they
    are), plus `head_from` = first."""
    b, t = mb["input_ids"].shape
    out = {k: v[:, first:] if isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == (b, t) else v
           for k, v in mb.items()}
    out["head_from"] = first
    return out


def output_layers(models: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The LM heads of the model chunks that have one (the last pipeline stage's), under any wrappers."""
    layers = []
    for model in models:
        while not hasattr(model, "output_layer") and hasattr(model, "module"):
            inner = model.module
            assert isinstance(inner, torch.nn.Module)  # what megatron's wrappers wrap
            model = inner
        if getattr(model, "post_process", False) and (layer := getattr(model, "output_layer", None)) is not None:
            layers.append(layer)
    return layers


def _from_position(start: dict, module: torch.nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook of an output layer: its hidden states [T, b, h] from position `start["at"]` on."""
    first = start["at"]
    if not first:
        return None
    return (args[0][first:], *args[1:])


def _sequence_multiple(models: list[torch.nn.Module]) -> int:
    """The sequence length must be a multiple of this: TP under sequence parallelism, else 1."""
    config = config_of(models[0])
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def _right_pad(tensor: torch.Tensor, multiple: int, *, positions: bool = False) -> torch.Tensor:
    """[b, T] -> [b, T'] with T' the next multiple of `multiple`: token 0 or, for `positions`, T..T'-1."""
    extra = -tensor.shape[1] % multiple
    if not extra:
        return tensor
    tail = torch.arange(tensor.shape[1], tensor.shape[1] + extra, device=tensor.device).expand(tensor.shape[0], -1)
    return torch.cat([tensor, tail if positions else torch.zeros_like(tail)], dim=1)
