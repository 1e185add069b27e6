"""The CPU device shim: lets megatron-core run on a machine without a GPU (gloo backend).

megatron-core assumes CUDA where the maths does not need it; on a machine with no GPU, `install()` redirects
exactly these to the CPU:
1. A `TorchFunctionMode` (`_CudaToCpuMode`), pushed once: a `device=` naming CUDA (or an integer ordinal) becomes
   "cpu"; `Tensor.cuda()` returns the tensor; `Tensor.to(<cuda>)` goes to the CPU; `Tensor.type()` with no argument
   reports CPU tensors under their CUDA names (megatron compares type strings).
2. On `torch.cuda`: `current_device` returns "cpu"; the RNG functions act on the CPU generator; `synchronize` and
   `empty_cache` do nothing; `Stream`, `current_stream`, `Event` and `stream(s)` are no-op stand-ins.
3. `tensor_parallel.random`'s `_get/_set_cuda_rng_state` act on the CPU generator.
4. MoE's `maybe_move_tensor_to_cpu` converts CPU tensors too (the all-to-all's split sizes).
5. `tensor_parallel.mappings`' `_gather_along_first_dim` / `_reduce_scatter_along_first_dim` with uneven splits:
   gloo needs equal sizes, so the gather pads and cuts, the reduce-scatter all-reduces and keeps this rank's piece
   (same sums, more bytes); equal splits go to megatron's own functions.

Invariants: `install()` is a no-op returning False when `torch.cuda.is_available()`; on CPU it is idempotent and
must run before megatron-core builds a model (`megatron_bridge.parallel.initialize` calls it first). The mode is
pushed on the calling thread's stack, so megatron work must happen on that thread. Nothing changes numerics; the
patches are process-wide.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_installed = False
_mode: _CudaToCpuMode | None = None

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


def gpu_available() -> bool:
    """True when CUDA is usable; the shim is then never installed."""
    return torch.cuda.is_available()


def is_installed() -> bool:
    """True when the CPU shim is active in this process."""
    return _installed


def compute_device() -> torch.device:
    """The device megatron work runs on here: the current CUDA device on GPU, the CPU otherwise."""
    if _installed or not gpu_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _names_cuda(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _is_device_like(value) -> bool:
    return isinstance(value, (str, torch.device)) or (isinstance(value, int) and not isinstance(value, bool))


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU (see the module docstring for the exact list)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _names_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if i > 0 and _is_device_like(a) and _names_cuda(a) else a
                         for i, a in enumerate(args))
        if func is torch.Tensor.type and len(args) == 1 and "dtype" not in kwargs:
            name = func(*args, **kwargs)
            return _CUDA_TYPE_NAMES.get(name, name)
        return func(*args, **kwargs)


def _cpu_get_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))  # not torch.manual_seed: that calls torch.cuda.manual_seed_all


def _nothing(*args, **kwargs) -> None:
    return None


class _CpuStream:
    """Stands in for CUDA streams and events: CPU work is synchronous, so waiting is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None) -> _CpuStream:
        return self

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's `maybe_move_tensor_to_cpu` for CPU tensors: the tensor itself, or its numpy array."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.detach().numpy()
    return tensor


def _uneven_gather(original):
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        longest = max(sizes)
        padded = torch.zeros((longest, *input_.shape[1:]), dtype=input_.dtype)
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, sizes, strict=True)], dim=0)
    return gather


def _uneven_reduce_scatter(original):
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        return torch.split(total, [int(n) for n in input_split_sizes], dim=0)[group.rank()].contiguous()
    return reduce_scatter


def install() -> bool:
    """Activate the CPU shim when no GPU is present. Returns True when it is (now or already) active."""
    global _installed, _mode
    if _installed:
        return True
    if gpu_available():
        return False
    # CPU stand-ins, of other types than torch's by design (a "cpu" device, streams that do nothing)
    cuda_shims = {"current_device": lambda: "cpu", "get_rng_state": _cpu_get_rng_state,
                  "set_rng_state": _cpu_set_rng_state, "manual_seed": _cpu_manual_seed, "synchronize": _nothing,
                  "empty_cache": _nothing, "Stream": _CpuStream, "Event": _CpuStream,
                  "current_stream": lambda device=None: _CpuStream(),
                  "stream": lambda stream=None: contextlib.nullcontext()}
    for name, shim in cuda_shims.items():
        setattr(torch.cuda, name, shim)
    from megatron.core.tensor_parallel import random as megatron_random
    megatron_random._get_cuda_rng_state = _cpu_get_rng_state
    megatron_random._set_cuda_rng_state = _cpu_set_rng_state
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = _to_host
    from megatron.core.tensor_parallel import mappings
    mappings._gather_along_first_dim = _uneven_gather(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter(mappings._reduce_scatter_along_first_dim)
    _mode = _CudaToCpuMode()
    _mode.__enter__()
    _installed = True
    return True
