"""What a one-machine run gets of this machine, decided before any part starts: the parts that compute and their
worker processes (`compute_parts`), the GPUs of each (`gpu_plan`, disjoint unless `run.share_gpus`; LaunchError
when they do not suffice), and on a machine without GPUs the OMP_NUM_THREADS of each part
(`cpu_threads_per_part`), the board on which the trainer and the explorers lend each other their cores
(`core_board`, rft/cores.py) and a hint when bfloat16 would be faster (`bf16_hint`). `visible_gpus` asks torch only
where a GPU driver's device node exists, so a CPU machine's launcher never imports it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from rft.cli.parts import EVALUATOR, SERVER
from rft.cores import native_bf16_flags, write_board
from rft.modes import mode
from rft.run.config import Config


class LaunchError(RuntimeError):
    """The run cannot be laid out on this machine; the message says what to change."""


# The device nodes a GPU driver makes on Linux: NVIDIA's, AMD's (ROCm, which torch.cuda also counts) and WSL's. With
# none of them torch sees no GPU, so the launcher need not import torch (seconds of CPU) to learn so.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def visible_gpus() -> list[str]:
    """This machine's GPUs as CUDA_VISIBLE_DEVICES entries (empty on a CPU machine). NVML only: no CUDA context; on
    a Linux machine with no GPU driver's device node (`GPU_DEVICE_NODES`), torch is not even imported."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    if sys.platform == "linux" and not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return []
    import torch
    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_plan(cfg: Config, roles: tuple[str, ...], gpus: list[str]) -> dict[str, str]:
    """Disjoint GPUs for the parts of a one-machine run: the trainer's TP x PP x DP first, then each explorer's
    tensor_parallel_size, then the evaluator's. Empty on a CPU machine; LaunchError when the GPUs do not suffice,
    unless `run.share_gpus`: then the parts take the GPUs round-robin and share them (a part never gets one GPU
    twice; the explorers' `gpu_memory_utilization` must leave room for the trainer on a shared GPU)."""
    if not gpus:
        return {}
    needs = compute_parts(cfg, roles)
    total = sum(n for _, n in needs)
    widest = max((n for _, n in needs), default=0)
    if widest > len(gpus) or (total > len(gpus) and not cfg.run.share_gpus):
        parts = " + ".join(f"{name} {n}" for name, n in needs)
        raise LaunchError(f"this machine has {len(gpus)} GPUs, the run needs {total} ({parts}): lower "
                          "trainer.data_parallel or explorer.replicas, start the explorers elsewhere (`rft explorer`)"
                          + ("" if widest > len(gpus) else ", or let the parts share GPUs (run.share_gpus: true)"))
    plan, next_gpu = {}, 0
    for name, n in needs:
        plan[name] = ",".join(gpus[(next_gpu + i) % len(gpus)] for i in range(n))
        next_gpu += n
    return plan


def compute_parts(cfg: Config, roles: tuple[str, ...]) -> list[tuple[str, int]]:
    """The parts of a one-machine run that compute, each with its number of worker processes (= GPUs on a GPU
    machine): the trainer's TP x PP x DP ranks, each explorer's tensor_parallel_size, the evaluator's."""
    t, tp = cfg.trainer, cfg.explorer.tensor_parallel_size
    parts: list[tuple[str, int]] = []
    if "trainer" in roles:
        parts.append(("trainer", t.tensor_parallel * t.pipeline_parallel * t.data_parallel))
    if "explorers" in roles:
        parts += [(f"explorer-{i}", tp) for i in range(cfg.explorer.replicas)]
    if "serve" in roles:
        parts.append((SERVER, tp))
    if cfg.eval.every_steps and "trainer" in roles and mode(cfg.run.mode).publishes_weights:
        parts.append((EVALUATOR, tp))
    return parts


def cpu_threads_per_part(cfg: Config, roles: tuple[str, ...], gpus: dict[str, str]) -> int | None:
    """On a machine without GPUs, the OMP_NUM_THREADS each part gets: this process's cores split evenly over the
    compute processes (`compute_parts`), at least 1. Parts that each spin as many threads as there are cores fight
    over them: on 2 cores the flagship step took twice as long. None (leave the environment alone) with GPUs, or
    when OMP_NUM_THREADS is set already (the operator's choice wins)."""
    if gpus or os.environ.get("OMP_NUM_THREADS"):
        return None
    processes = sum(n for _, n in compute_parts(cfg, roles))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, processes))
    print(f"[rft] {cores} CPU cores for {processes} compute processes: OMP_NUM_THREADS={threads} each "
          "(set OMP_NUM_THREADS to choose)", flush=True)
    return threads


def bf16_hint(cfg: Config, gpus: dict[str, str], cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """On a machine without GPUs whose CPU multiplies bfloat16 natively, a float32 run is told that
    `model.dtype=bfloat16` is faster here; True when it was. The default stays float32: without those instructions
    vLLM's bfloat16 is far slower, and a config should train alike on every machine it meets."""
    flags = native_bf16_flags(cpuinfo) if not gpus and cfg.model.dtype == "float32" else []
    if flags:
        print(f"[rft] this CPU computes bfloat16 natively ({', '.join(flags)}): --set model.dtype=bfloat16 trained the "
              "flagship's steps about 1.5x faster on one (docs/benchmarks.md, \"bfloat16 on the CPU\")", flush=True)
    return bool(flags)


def core_board(cfg: Config, roles: tuple[str, ...], threads: int | None, run_dir: Path) -> dict[str, str]:
    """Cores that follow the work (rft/cores.py): when `cpu_threads_per_part` split the cores (`threads` not None)
    and the run has a trainer and explorers here, a board at `run_dir/cores` on which the trainer and each explorer
    mark themselves busy or waiting, and from which those that compute take the threads of those that wait. Returns
    each part's `RFT_CORES` value ({} without a board; `rft run --set trainer.borrow_cores=false` turns it off)."""
    if threads is None or "trainer" not in roles or "explorers" not in roles or not cfg.trainer.borrow_cores:
        return {}
    parts = {name: (threads * n, n) for name, n in compute_parts(cfg, roles)
             if name == "trainer" or name.startswith("explorer-")}
    board = write_board(run_dir / "cores", parts)
    print(f"[rft] cores follow the work: the trainer and the explorers take the threads of those that wait "
          f"({run_dir / 'cores'})", flush=True)
    return board

