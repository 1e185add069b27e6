"""The CPU device shim: lets megatron-core 0.16.1 run on a machine without a GPU (gloo backend).

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths: it asks
`torch.cuda.current_device()`, creates tensors with `device="cuda"`, moves tensors with `.cuda()` /
`.to("cuda")`, keeps its dropout RNG states with the CUDA RNG functions, and its optimizer asserts
that parameters are `torch.cuda.FloatTensor`. On a machine with no GPU, `install()` redirects exactly
these to the CPU, and nothing else:

1. A `torch.overrides.TorchFunctionMode` (`_CudaToCpuMode`), pushed once for the whole process:
   - any `device=` keyword argument naming CUDA (`"cuda"`, `"cuda:N"`, `torch.device("cuda")`, or an
     integer, which torch reads as a CUDA ordinal) becomes `"cpu"`;
   - `Tensor.cuda(...)` returns the tensor itself (it is already on the CPU);
   - `Tensor.to(...)` with a CUDA device (positional or keyword) goes to the CPU instead;
   - `Tensor.type()` called with no argument (a query, not a cast) reports CPU tensors under their
     CUDA names (`torch.FloatTensor` -> `torch.cuda.FloatTensor`), because megatron's optimizer and
     grad-clipping check parameter types by comparing against those strings.
2. Functions replaced on `torch.cuda`: `current_device` returns `"cpu"`; `get_rng_state`,
   `set_rng_state` and `manual_seed` act on the CPU generator; `synchronize` and
   `empty_cache` do nothing.
3. Functions replaced on `megatron.core.tensor_parallel.random`: `_get_cuda_rng_state` and
   `_set_cuda_rng_state` act on the CPU generator (megatron's `CudaRNGStatesTracker`, used for
   tensor-parallel dropout and initialisation, forks and restores RNG state through them).

Invariants: `install()` is a no-op returning False when `torch.cuda.is_available()`; on CPU it is
idempotent and must run before megatron-core builds a model (`megatron_bridge.parallel.initialize`
calls it first). The mode is pushed on the calling thread's torch-function-mode stack, so megatron
work must happen on that thread (autograd's CPU backward runs there too). Nothing here changes
numerics: every redirected call does on the CPU what it would have done on the GPU. The patches are
process-wide: other code in a CPU process also sees CUDA device arguments go to the CPU and
`Tensor.type()` report CUDA names.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_installed = False
_mode: "_CudaToCpuMode | None" = None

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


def install() -> bool:
    """Activate the CPU shim when no GPU is present. Returns True when it is (now or already) active."""
    global _installed, _mode
    if _installed:
        return True
    if gpu_available():
        return False
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = _cpu_get_rng_state
    torch.cuda.set_rng_state = _cpu_set_rng_state
    torch.cuda.manual_seed = _cpu_manual_seed
    torch.cuda.synchronize = _nothing
    torch.cuda.empty_cache = _nothing
    from megatron.core.tensor_parallel import random as megatron_random
    megatron_random._get_cuda_rng_state = _cpu_get_rng_state
    megatron_random._set_cuda_rng_state = _cpu_set_rng_state
    _mode = _CudaToCpuMode()
    _mode.__enter__()
    _installed = True
    return True
