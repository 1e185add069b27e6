"""Export a TP/PP-sharded megatron model back to Hugging Face tensors, streamed in buckets.

Protocol (call on every rank, and consume the iterator to the end on every rank): for each HF tensor group in a fixed
global order (embedding, layer 0..L-1, final norm, output layer), the owning pipeline stage's TP ranks of
data-parallel replica 0 (a routed expert's: of the expert-parallel rank holding it, expert-DP replica 0) gather their
shards to TP rank 0, which merges them into full HF tensors. Then, by mode:
- funnel (`per_stage=False`; the push path and `save_hf`): TP rank 0 sends the tensors point-to-point to global rank
  0 (a shape/dtype header, then the data), which packs every tensor into buckets; other ranks yield nothing.
- per stage (`per_stage=True`; the pull path): each pipeline stage's publisher (TP rank 0 of DP replica 0:
  `ParallelLayout.is_stage_publisher`) packs the tensors its stage owns, in the same global order; stages run in
  parallel; only a routed expert held on another expert-parallel rank is sent. Every HF tensor is yielded by exactly
  one stage (embedding: first; final norm and output layer: last; a tied embedding's last-stage copy: never).
Replicas with data-parallel rank > 0 hold identical weights and are idle.

Memory bound on a yielding rank: one bucket (at most `bucket_bytes`, or a single larger tensor) plus the HF tensors
of the parameter being converted. Yielded tensors live on the compute device; the consumer must drop a bucket
before asking for the next.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

import megatron_bridge.device as device
import megatron_bridge.parallel as parallel
from megatron_bridge.hf_checkpoint import HFDirectoryWriter
from megatron_bridge.info import BridgeInfo
from megatron_bridge.lora import MergedParameters
from megatron_bridge.mapping import ParamMapping
from megatron_bridge.model import unwrap

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER_LEN = 6  # ndim, up to 4 dims, dtype code


def _gather_tp(mapping: ParamMapping, local: torch.Tensor, info: BridgeInfo,
               where: parallel.ParallelLayout) -> dict[str, torch.Tensor] | None:
    """Full HF tensors on TP rank 0 (None on the other TP ranks, which contribute their shard)."""
    from megatron.core import parallel_state as ps

    if not mapping.tp_sharded or where.tp == 1:
        return mapping.merge_shards([local], info.dims) if where.tp_rank == 0 else None
    group = ps.get_tensor_model_parallel_group()
    root = dist.get_process_group_ranks(group)[0]
    shards = [torch.empty_like(local) for _ in range(where.tp)] if where.tp_rank == 0 else None
    dist.gather(local.contiguous(), gather_list=shards, dst=root, group=group)
    return mapping.merge_shards(shards, info.dims) if shards is not None else None  # TP rank 0 gathered them


def _send(tensor: torch.Tensor, dst: int) -> None:
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=tensor.device)
    header[0] = tensor.dim()
    header[1:1 + tensor.dim()] = torch.tensor(tensor.shape)
    header[-1] = _DTYPES.index(tensor.dtype)
    dist.send(header, dst)
    dist.send(tensor.contiguous(), dst)


def _recv(src: int) -> torch.Tensor:
    header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=device.compute_device())
    dist.recv(header, src)
    ndim = int(header[0])
    out = torch.empty(tuple(int(d) for d in header[1:1 + ndim]), dtype=_DTYPES[int(header[-1])],
                      device=device.compute_device())
    dist.recv(out, src)
    return out


def _holder_rank(stage: int, owner_ep: int | None, where: parallel.ParallelLayout) -> int:
    """Global rank of the TP rank 0 that gathers a parameter of pipeline stage `stage`: data-parallel replica 0's
    for dense weights, expert-parallel rank `owner_ep`'s (expert data-parallel replica 0) for a routed expert's.
    Megatron's rank orders put pipeline stages outermost, and a stage's expert-parallel ranks tp apart."""
    return stage * (where.world_size // where.pp) + (owner_ep or 0) * where.tp


def _fetch(mapping: ParamMapping, params: dict[str, torch.Tensor], info: BridgeInfo,
           where: parallel.ParallelLayout, per_stage: bool) -> dict[str, torch.Tensor] | None:
    """This parameter's HF tensors on global rank 0 (funnel) or on its stage's publisher (per stage); None
    elsewhere (after taking part)."""
    stage = info.owner_stage(mapping.megatron)
    owner_ep = info.owner_ep_rank(mapping.megatron)
    receiver = _holder_rank(stage, None, where) if per_stage else 0
    holder = _holder_rank(stage, owner_ep, where)
    if owner_ep is None:
        holds = where.dp_rank == 0 and where.pp_rank == stage
    else:  # whole experts live on one expert-parallel rank; its expert replicas > 0 hold copies
        holds = where.expert_dp_rank == 0 and where.ep_rank == owner_ep and where.pp_rank == stage
    if holds:
        local = params[info.local_name(mapping.megatron, stage, where.ep_rank)].detach()
        tensors = _gather_tp(mapping, local, info, where)
        if tensors is None:
            return None
        if where.rank != holder:
            raise RuntimeError(f"{mapping.megatron}: gathered on rank {where.rank}, expected rank {holder} "
                               "(megatron's rank order is not the default one)")
        if holder == receiver:
            return tensors
        for name in mapping.hf_names:
            _send(tensors[name], dst=receiver)
        return None
    if where.rank == receiver:
        return {name: _recv(holder) for name in mapping.hf_names}
    return None


def iter_hf_buckets(models: list[torch.nn.Module], bucket_bytes: int, *, per_stage: bool = False,
                    mappings: list[ParamMapping] | None = None,
                    merged: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """Yield {HF name: full tensor} buckets of at most `bucket_bytes` (see module doc): every tensor of the
    model on global rank 0 (`per_stage=False`), or each pipeline stage's own tensors on that stage's
    publisher (`per_stage=True`; with pp=1 the two are the same).

    A single tensor larger than `bucket_bytes` comes alone in its own bucket. Tensor names and
    shapes are exactly those of the HF checkpoint (vocabulary padding removed; no `lm_head.weight`
    for tied embeddings). `mappings`: the layer-resolved mappings to export, in pipeline order (default: the
    model's, `BridgeInfo.resolved_mappings`; LoRA adapters: `megatron_bridge.lora.adapter_mappings`). `merged`: a
    LoRA linear's weight is exported as W + s * B A (megatron_bridge.lora.MergedParameters).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    model = unwrap(models[0])
    info: BridgeInfo = model.bridge_info
    params = MergedParameters(model) if merged else dict(model.named_parameters())
    where = parallel.layout()
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    with torch.no_grad():
        for mapping in info.resolved_mappings() if mappings is None else mappings:
            tensors = _fetch(mapping, params, info, where, per_stage)
            for name, tensor in (tensors or {}).items():
                nbytes = tensor.numel() * tensor.element_size()
                if bucket and size + nbytes > bucket_bytes:
                    yield bucket
                    bucket, size = {}, 0
                bucket[name] = tensor
                size += nbytes
            tensors = None
    if bucket:
        yield bucket


def save_hf(models: list[torch.nn.Module], out_dir: str | Path, *, bucket_bytes: int = 256 << 20,
            merged: bool = False) -> Path | None:
    """Write an HF model directory (safetensors shards, index, config, tokenizer files) from global rank 0
    (every tensor funnels to it: `iter_hf_buckets(per_stage=False)`).

    Call on every rank. Returns the directory on rank 0 and None elsewhere, after a barrier, so the
    directory is complete when any rank returns. `merged`: LoRA adapters merged into their base weights.
    """
    info: BridgeInfo = unwrap(models[0]).bridge_info
    writer = HFDirectoryWriter(out_dir, info.hf_dir) if parallel.layout().is_publisher else None
    dtype = None
    for bucket in iter_hf_buckets(models, bucket_bytes, merged=merged):
        dtype = next(iter(bucket.values())).dtype
        assert writer is not None  # the buckets come out on the publishing rank only (per_stage=False)
        writer.add_bucket({k: v.cpu() for k, v in bucket.items()})
    result = None
    if writer is not None:
        result = writer.finish()
        _set_config_dtype(result / "config.json", dtype)
    dist.barrier()
    return result


def _set_config_dtype(config_file: Path, dtype: torch.dtype | None) -> None:
    if dtype is None or not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    name = str(dtype).removeprefix("torch.")
    config.update({"dtype": name} if "torch_dtype" not in config else {"torch_dtype": name})
    config_file.write_text(json.dumps(config, indent=2) + "\n")
