"""The trainer's control-plane collectives: rank 0 reads Kafka and the other ranks receive the same bytes.

Experience records are broadcast as the raw msgpack bytes that came off Kafka (never pickled objects) over a gloo
group, which works for CPU tensors whatever the training backend (NCCL on GPU). Every function here is a
collective: all ranks call it in the same order.
"""
from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

_CONTROL_GROUP = None


def rank() -> int:
    """This process's global rank; before torch.distributed starts, as torchrun (RANK) or srun (SLURM_PROCID) set it."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def world_size() -> int:
    """The number of trainer processes; before torch.distributed starts, from WORLD_SIZE or SLURM_NTASKS (else 1)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))


def _control_group():
    global _CONTROL_GROUP
    if _CONTROL_GROUP is None:
        _CONTROL_GROUP = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
    return _CONTROL_GROUP


def broadcast_bytes(items: list[bytes] | None) -> list[bytes]:
    """Rank 0 passes its list; every rank returns the same list."""
    if world_size() == 1:
        return list(items or [])
    group = _control_group()
    mine = list(items or []) if rank() == 0 else []
    sizes = torch.tensor([len(x) for x in mine], dtype=torch.int64)
    count = torch.tensor([len(sizes)], dtype=torch.int64)
    dist.broadcast(count, src=0, group=group)
    if rank() != 0:
        sizes = torch.empty(int(count.item()), dtype=torch.int64)
    dist.broadcast(sizes, src=0, group=group)
    total = int(sizes.sum().item())
    if rank() == 0:
        payload = (torch.from_numpy(np.frombuffer(b"".join(mine), dtype=np.uint8).copy()) if total
                   else torch.empty(0, dtype=torch.uint8))
    else:
        payload = torch.empty(total, dtype=torch.uint8)
    if total:
        dist.broadcast(payload, src=0, group=group)
    raw = payload.numpy().tobytes()
    out, offset = [], 0
    for size in sizes.tolist():
        out.append(raw[offset:offset + size])
        offset += size
    return out


def broadcast_flag(value: bool) -> bool:
    """Rank 0's boolean, on every rank (e.g. 'stop now')."""
    if world_size() == 1:
        return value
    t = torch.tensor([1 if value else 0], dtype=torch.int64)
    dist.broadcast(t, src=0, group=_control_group())
    return bool(t.item())


def barrier() -> None:
    if world_size() > 1:
        dist.barrier(group=_control_group())
