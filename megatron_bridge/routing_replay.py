"""Routing replay: train an MoE model with each token routed to the experts the inference engine chose.

megatron-core 0.16.1's `RouterReplay` (transformer/moe/router_replay.py) is the hook: a router that holds one routes
through `RouterReplay.get_replay_topk`, which in `REPLAY_FORWARD` takes the target top-k indices instead of computing
them and gathers the router's scores at those indices (so the gates' weights still come from the trainer's router, with
gradients; only the choice of experts is replayed). `PartialReplay` (`partial_replay()`) extends it to tokens without a
record: a target row of -1 routes that token by the trainer's own top-k, so prompt positions an engine did not record,
padding, and rows of records without routing route normally.

Micro-batch contract (rft.trainer.batch): `routed_experts` [b, T, L, k] int32, for input position t of row i the
expert ids of the MoE layer `routed_layers[l]` (0-based decoder layer index, [L] int64), -1 where not recorded. A
router of megatron layer number n (1-based, global over pipeline stages) takes column `routed_layers.index(n - 1)`;
a micro-batch without `routed_experts` routes every token normally. Megatron's routers see their tokens in [s, b]
order (sequence-major), a tensor-parallel rank only its sequence slice when sequence parallelism is on; `targets`
lays the ids out that way. Activation recomputation (megatron's REPLAY_BACKWARD) is not used by this trainer.
"""
from __future__ import annotations

from functools import cache

import torch


@cache
def partial_replay():
    """The `PartialReplay` class and megatron's `RouterReplayAction` (imported on first use: importing
    megatron_bridge stays cheap)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class PartialReplay(RouterReplay):
        """megatron's RouterReplay for one router, where a target row of -1 means "route this token normally"."""

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
                return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            target = self.target_topk_idx.to(scores.device)
            if target.shape != (scores.shape[0], topk):
                raise ValueError(f"routing replay: {tuple(target.shape)} target expert ids for {scores.shape[0]} "
                                 f"tokens x top-{topk} (the micro-batch's routed_experts do not match the model)")
            _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            indices = torch.where((target >= 0).all(-1, keepdim=True), target.long(), own)
            return scores.gather(1, indices), indices

    return PartialReplay, RouterReplayAction


def _routers(model: torch.nn.Module) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def install(models: list[torch.nn.Module]) -> int:
    """Give every top-k router of `models` (a policy's model chunks) a `PartialReplay`; returns how many routers.
    Until `set_targets` is called they route normally."""
    replay_class, _ = partial_replay()
    routers = [router for model in models for router in _routers(model)]
    for router in routers:
        router.router_replay = replay_class()
    return len(routers)


def set_targets(model: torch.nn.Module, micro_batch: dict[str, torch.Tensor]) -> None:
    """Before `model`'s forward on `micro_batch`: replay its `routed_experts` in every router of `model` that has a
    `PartialReplay` (install), or route normally when the micro-batch has none. ValueError naming the layer when the
    model routes at a layer the micro-batch has no column for."""
    replay_class, action = partial_replay()
    routed = micro_batch.get("routed_experts")
    layers = micro_batch["routed_layers"].tolist() if routed is not None else []
    for router in _routers(model):
        replay = router.router_replay
        if not isinstance(replay, replay_class):
            continue
        replay.clear_indices()
        if routed is None:
            replay.clear_router_replay_action()
            continue
        layer = router.layer_number - 1
        if layer not in layers:
            raise ValueError(f"routing replay: the model routes at decoder layer {layer}, but the records carry "
                             f"routing for layers {layers} (recorded with another model?)")
        replay.set_target_indices(targets(routed[:, :, layers.index(layer)], router.config))
        replay.set_router_replay_action(action.REPLAY_FORWARD)


def targets(ids: torch.Tensor, config) -> torch.Tensor:
    """[b, T, k] ids -> the [tokens, k] rows one router sees: sequence-major ([T, b] flattened), this tensor-parallel
    rank's slice of T under sequence parallelism (T right-padded with -1 to a multiple of TP, as
    megatron_bridge.schedule pads the tokens)."""
    from megatron.core import parallel_state

    ids = ids.transpose(0, 1)
    if getattr(config, "sequence_parallel", False):
        tp, rank = (parallel_state.get_tensor_model_parallel_world_size(),
                    parallel_state.get_tensor_model_parallel_rank())
        extra = -ids.shape[0] % tp  # the schedule right-pads the sequence to a multiple of TP: those route normally
        ids = torch.cat([ids, ids.new_full((extra, *ids.shape[1:]), -1)]) if extra else ids
        step = ids.shape[0] // tp
        ids = ids[rank * step:(rank + 1) * step]
    return ids.reshape(-1, ids.shape[-1]).contiguous()
