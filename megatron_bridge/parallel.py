"""torch.distributed and megatron parallel_state, set up and torn down in one place.

Layout: world = tp * pp * dp. Megatron's default rank order ("tp-cp-ep-dp-pp") puts the
tensor-parallel ranks of one model replica next to each other, then data-parallel replicas, then
pipeline stages. Expert parallelism (ep, mixtures of experts) is carved out of the data-parallel ranks:
the experts of a layer are split over ep ranks of one stage, so tp * ep must divide tp * dp (the expert
weights keep tensor parallelism tp; expert data parallelism is dp / ep); attention and the other dense
weights stay replicated over all dp ranks. Megatron's expert rank order ("tp-ep-dp-pp") puts a stage's
expert-parallel ranks tp apart. Global rank 0 is TP rank 0, DP rank 0 of the first pipeline stage; it is the
publishing rank for exported weights (each stage's TP rank 0, DP rank 0 publishes its own stage's in a
per-stage export).

Backend: gloo on CPU (with `megatron_bridge.device` installed first), nccl on GPU. Rendezvous is
env:// as set by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); under srun the
SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID variables stand in for RANK / WORLD_SIZE / LOCAL_RANK
(MASTER_ADDR / MASTER_PORT must still be exported by the launcher). A plain single process with none
of these gets world size 1 on a free local port.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import megatron_bridge.device as device
from rft.processes import free_port

_SLURM_TO_TORCH = {"SLURM_PROCID": "RANK", "SLURM_NTASKS": "WORLD_SIZE", "SLURM_LOCALID": "LOCAL_RANK"}


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits. Sizes are global; ranks are within their group."""

    world_size: int
    rank: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    backend: str
    ep: int = 1
    ep_rank: int = 0
    expert_dp_rank: int = 0  # rank among the replicas of this rank's experts (0..dp/ep-1)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_publisher(self) -> bool:
        """Global rank 0: receives gathered weights for export."""
        return self.rank == 0

    @property
    def is_stage_publisher(self) -> bool:
        """TP rank 0 of data-parallel replica 0 in its pipeline stage: holds that stage's full HF tensors in a
        per-stage export (megatron_bridge.export). Global rank 0 is the first stage's."""
        return self.tp_rank == 0 and self.dp_rank == 0


def _fill_env_from_slurm() -> None:
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    for slurm_name, torch_name in _SLURM_TO_TORCH.items():
        if slurm_name in os.environ:
            os.environ.setdefault(torch_name, os.environ[slurm_name])


def _fill_env_for_single_process() -> None:
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def initialize(tp: int = 1, pp: int = 1, *, ep: int = 1, seed: int = 0, timeout_minutes: int = 30) -> ParallelLayout:
    """Start torch.distributed (if not yet started) and megatron's model-parallel groups for (tp, pp, ep).

    dp = world_size / (tp * pp), and ep must divide dp; raises ValueError naming the sizes when they do
    not divide.
    Seeds torch and megatron's tensor-parallel RNG tracker with `seed` (megatron offsets it per
    TP/PP rank for dropout; the bridge loads every weight, so initialisation RNG does not matter).
    Idempotent for the same (tp, pp); call `destroy()` before re-initialising with other sizes.
    """
    from megatron.core import parallel_state, tensor_parallel

    if tp < 1 or pp < 1 or ep < 1:
        raise ValueError(f"tensor, pipeline and expert parallel sizes must be >= 1, got tp={tp} pp={pp} ep={ep}")
    on_cpu = device.install()
    _fill_env_from_slurm()
    _fill_env_for_single_process()
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}")
    if (world // (tp * pp)) % ep:
        raise ValueError(f"expert parallel size {ep} does not divide the data parallel size {world // (tp * pp)} "
                         f"(world size {world} / (tp {tp} x pp {pp})): experts are split over data-parallel ranks")
    backend = "gloo" if on_cpu else "nccl"
    if not dist.is_initialized():
        if not on_cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, init_method="env://",
                                timeout=timedelta(minutes=timeout_minutes))
    if parallel_state.model_parallel_is_initialized():
        current = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_pipeline_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_world_size())
        if current != (tp, pp, ep):
            raise RuntimeError(f"megatron parallel state already set up for tp,pp,ep={current}; "
                               f"call destroy() before initialize(tp={tp}, pp={pp}, ep={ep})")
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
            distributed_timeout_minutes=timeout_minutes, create_gloo_process_groups=not on_cpu)
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return layout()


def layout() -> ParallelLayout:
    """The layout of the already-initialised process."""
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        world_size=dist.get_world_size(), rank=dist.get_rank(),
        tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
        backend=dist.get_backend(), ep=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(), expert_dp_rank=ps.get_expert_data_parallel_rank())


def destroy(*, keep_process_group: bool = False) -> None:
    """Tear down megatron's groups and the default process group (safe to call when not initialised).

    `keep_process_group=True` keeps torch.distributed up so `initialize` can set up another (tp, pp)
    over the same processes (a process group cannot be re-created under one torchrun rendezvous).
    """
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized() and not keep_process_group:
        dist.destroy_process_group()
