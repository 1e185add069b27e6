"""Checks on tensors that more than one layer makes: the trainer's gradients and weights before a step or a publish
(megatron_bridge.policy), a stored version's tensors before an explorer loads it (rft.weights.store). torch is
imported when a check runs, not with this module."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """True when none of the floating-point `tensors` holds a NaN or an infinity (True for none; one host sync).

    Each tensor is reduced to its minimum and maximum: a NaN makes both NaN, and an infinity is one of them. That is
    one read of the tensor, where `isfinite(t).all()` also writes and reads a mask as large as it
    (docs/benchmarks.md)."""
    import torch

    extremes = [torch.stack(torch.aminmax(t)).float() for t in tensors if t.numel()]
    return not extremes or bool(torch.isfinite(torch.cat(extremes)).all())
