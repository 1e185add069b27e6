"""The MoE router's auxiliary losses in the trainer: load balancing and z-loss, scaled and reported per step.

megatron-core attaches both losses to the router's activations (`MoEAuxLossAutoScaler`) during each training
forward and records their values in its layer-wise tracker. In its per-token-loss mode it multiplies them by the
micro-batch's token count, expecting `finalize_model_grads` to divide every gradient by the step's token total;
rft's losses are already global (megatron_bridge.policy: no division there), so `prepare` turns that
multiplication off on every router, and `set_step_coefficients` divides the configured coefficients by the
number of micro-batches in the step, globally: a step's gradient then carries

    coeff x mean over (micro-batch, data-parallel rank) of megatron's per-micro-batch loss

summed over MoE layers, the same scale as megatron's default (per-sequence-average) mode. `step_metrics` reads
and clears the tracker: `moe_load_balancing_loss` and `moe_z_loss`, each the mean over MoE layers,
micro-batches and data-parallel ranks of the unscaled loss (present only when its coefficient is > 0).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import megatron_bridge.device as device
from megatron_bridge.model import config_of

if TYPE_CHECKING:
    from megatron.core.transformer.moe.router import TopKRouter

TRACKED = {"load_balancing_loss": "moe_load_balancing_loss", "z_loss": "moe_z_loss"}


def routers(models: list[torch.nn.Module]) -> list[TopKRouter]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for model in models for m in model.modules() if isinstance(m, TopKRouter)]


def prepare(models: list[torch.nn.Module]) -> tuple[float, float]:
    """Take the configured (aux, z) coefficients from the models' config and stop the routers scaling their
    losses by token counts. Returns the configured coefficients (0.0 when off)."""
    config = config_of(models[0])
    for router in routers(models):
        if router.config is not config:
            raise RuntimeError("a router does not share the model's TransformerConfig; its loss coefficients "
                               "could not be scaled per step")
        router.calculate_per_token_loss = False
    return float(config.moe_aux_loss_coeff or 0.0), float(config.moe_z_loss_coeff or 0.0)


def set_step_coefficients(models: list[torch.nn.Module], base: tuple[float, float], micro_batches: int,
                          dp_group) -> int:
    """Scale the coefficients for a step of `micro_batches` on this rank (summed over the data-parallel group);
    returns the global count."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    total = torch.tensor([micro_batches], dtype=torch.float64, device=device.compute_device())
    dist.all_reduce(total, group=dp_group)
    count = int(total.item())
    config = config_of(models[0])
    aux, z = base
    config.moe_aux_loss_coeff = aux / count if aux else 0.0
    config.moe_z_loss_coeff = z / count if z else None
    clear_aux_losses_tracker()
    return count


def step_metrics(models: list[torch.nn.Module], base: tuple[float, float], count: int, dp_group) -> dict[str, float]:
    """The step's mean losses (see the module doc) on every rank of the model replica's last stage and elsewhere
    alike; clears the tracker."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    config = config_of(models[0])
    moe_layers = sum(config.moe_layer_freq) if isinstance(config.moe_layer_freq, list) else config.num_layers
    tracker = get_moe_layer_wise_logging_tracker()
    metrics = {}
    for name, metric in TRACKED.items():
        enabled = base[0] if name == "load_balancing_loss" else base[1]
        if not enabled:
            continue
        if name not in tracker:  # this rank's stage traced no router: keep the collectives in step
            tracker[name] = {"values": torch.zeros(config.num_layers, device=device.compute_device()),
                             "reduce_group": None, "avg_group": None}
        reduce_aux_losses_tracker_across_ranks([name])
        values = tracker[name]["values"].double()
        per_micro_batch = values.sum() / moe_layers
        if name == "z_loss":  # megatron averages only the load-balancing loss over ranks holding other tokens
            dist.all_reduce(per_micro_batch, group=dp_group, op=dist.ReduceOp.AVG)
            if config.sequence_parallel:  # each TP rank routed its own slice of the sequence
                dist.all_reduce(per_micro_batch, group=ps.get_tensor_model_parallel_group(), op=dist.ReduceOp.AVG)
        metrics[metric] = float(per_micro_batch) / max(count // dist.get_world_size(dp_group), 1)
    clear_aux_losses_tracker()
    return metrics
