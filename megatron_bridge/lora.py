"""LoRA adapters on megatron-core's tensor-parallel linears, and their PEFT layout.

Model: a targeted linear W computes `W x + s * B (A x)`, A [r, in], B [out, r], s = alpha / r; dropout applies to x
on the adapter path only. A starts Kaiming-uniform, B at zero (version 0 is the base model). Base weights are
frozen: DDP, Adam's state and gradient clipping cover the adapters alone. Targets (`model.lora.target_modules`):
`linear_qkv` (HF q/k/v_proj), `linear_proj` (o_proj), `linear_fc1` (gate/up_proj), `linear_fc2` (down_proj).

Tensor parallelism (Megatron-Bridge / NeMo's parallel adapters with megatron's region mappings; every TP layout
computes the unsharded function and gradient):
- column-parallel base (linear_qkv, linear_fc1): A replicated [r, in], B split on out; `h = A x` then
  `copy_to_tensor_model_parallel_region(h)` before B, so A's gradient is the full one on every rank.
- row-parallel base (linear_proj, linear_fc2): A split on in, B replicated; `h =
  reduce_from_tensor_model_parallel_region(A_t x_t)`, then `B h` is added to the base's reduced output.
Split parameters carry megatron's TP attributes; replicated ones count once, on TP rank 0. `sharded_state_dict`
declares the same axes, so checkpoints reshard across TP/PP. No sequence parallelism, no TE fused layers.
`load_adapter` requires a PEFT adapter's projections that share one A here to carry the same A.
Initialisation is layout independent: each full A is drawn from (seed, global parameter name), each rank keeps its
slice. PEFT layout (`adapter_mappings`, names `base_model.model.<hf module>.lora_A.weight`): a LoRA on fused QKV is
three PEFT adapters q/k/v_proj sharing A (B split as the base QKV weight is), gate/up_proj share fc1's A.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from megatron_bridge.hf_checkpoint import HFCheckpoint
from megatron_bridge.mapping import QKV, ColumnParallel, GatedMLP, ModelDims, ParamMapping, Replicated, RowParallel
from rft.models.config import LORA_TARGETS

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

    from megatron_bridge.info import BridgeInfo
    from rft.models.config import LoraConfig

TARGETS = LORA_TARGETS  # megatron linears that take adapters (model.lora.target_modules)
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
A, B = "lora_a", "lora_b"  # the adapter parameters' names on a linear (`...linear_qkv.lora_a`)


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One linear's adapter settings: rank r, scaling s = alpha / r, dropout probability on its input."""
    rank: int
    alpha: float
    dropout: float

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def adapter_of(lora: LoraConfig, target: str) -> Adapter | None:
    """The adapter `lora` puts on the linear named `target` (one of TARGETS), None when it targets another."""
    if not lora.rank or target not in lora.target_modules:
        return None
    return Adapter(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout)


class _LoRA:
    """What both LoRA linears share: the adapter parameters beside megatron's own, and the adapter path. Mixed into
    megatron's Column/RowParallelLinear, whose attributes and methods it uses (declared here for the type checker)."""
    config: TransformerConfig
    weight: torch.Tensor
    tp_group: torch.distributed.ProcessGroup | None
    if TYPE_CHECKING:
        def state_dict(self, *, prefix: str, keep_vars: bool) -> dict[str, torch.Tensor]: ...

    adapter: Adapter
    lora_a: torch.nn.Parameter
    lora_b: torch.nn.Parameter
    lora_dropout: torch.nn.Module
    lora_off: bool  # set by `disabled` only

    def _add_adapter(self, adapter: Adapter, in_features: int, out_features: int, *, split_a: bool) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        if getattr(self.config, "sequence_parallel", False):
            raise ValueError("LoRA adapters do not support sequence parallelism")
        self.adapter = adapter
        dtype, device = self.weight.dtype, self.weight.device
        self.lora_a = torch.nn.Parameter(torch.zeros(adapter.rank, in_features, dtype=dtype, device=device))
        self.lora_b = torch.nn.Parameter(torch.zeros(out_features, adapter.rank, dtype=dtype, device=device))
        split, dim = (self.lora_a, 1) if split_a else (self.lora_b, 0)
        set_tensor_model_parallel_attributes(split, True, dim, 1)
        self.lora_dropout = torch.nn.Dropout(adapter.dropout) if adapter.dropout else torch.nn.Identity()

    def _low_rank(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.lora_dropout(x), self.lora_a)

    def _scaling(self) -> float:
        return 0.0 if getattr(self, "lora_off", False) else self.adapter.scaling

    def _sharded(self, axes: dict[str, int], prefix: str, sharded_offsets, metadata):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                   sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])


def lora_linears():
    """The two LoRA linear classes (megatron imported on first use)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    class LoRAColumnParallelLinear(_LoRA, ColumnParallelLinear):
        """megatron's ColumnParallelLinear plus a LoRA adapter: A replicated, B split on out (module docstring)."""

        def __init__(self, *args, lora_adapter: Adapter, lora_fc1: bool = False, **kwargs):
            super().__init__(*args, **kwargs)
            # a gated MLP's fc1: B's rows are [gate; up] per TP shard, as the weight's (checkpoint layout below)
            self.lora_gated = lora_fc1 and self.config.gated_linear_unit
            if self.gather_output:
                raise ValueError("a LoRA column-parallel linear needs gather_output=False")
            self._add_adapter(lora_adapter, self.input_size, self.output_size_per_partition, split_a=False)

        def forward(self, input_, weight=None, runtime_gather_output=None):
            output, bias = super().forward(input_, weight, runtime_gather_output)
            h = copy_to_tensor_model_parallel_region(self._low_rank(input_), group=self.tp_group)
            return output + F.linear(h, self.lora_b) * self._scaling(), bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            state = self._sharded({"weight": 0, "bias": 0, B: 0}, prefix, sharded_offsets, metadata)
            if self.lora_gated:  # megatron's MLP does this for fc1's weight and bias, not for our B
                state[f"{prefix}{B}"] = apply_swiglu_sharded_factory(
                    state[f"{prefix}{B}"], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
            return state

    class LoRARowParallelLinear(_LoRA, RowParallelLinear):
        """megatron's RowParallelLinear plus a LoRA adapter: A split on in, B replicated (module docstring)."""

        def __init__(self, *args, lora_adapter: Adapter, **kwargs):
            super().__init__(*args, **kwargs)
            if not self.input_is_parallel:
                raise ValueError("a LoRA row-parallel linear needs input_is_parallel=True")
            self._add_adapter(lora_adapter, self.input_size_per_partition, self.output_size, split_a=True)

        def forward(self, input_):
            output, bias = super().forward(input_)
            h = reduce_from_tensor_model_parallel_region(self._low_rank(input_), group=self.tp_group)
            return output + F.linear(h, self.lora_b) * self._scaling(), bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return self._sharded({"weight": 1, A: 1}, prefix, sharded_offsets, metadata)

    return LoRAColumnParallelLinear, LoRARowParallelLinear


def layer_spec(lora: LoraConfig, *, qk_layernorm: bool = False):
    """megatron's local GPT layer spec (RMSNorm; q/k norms for `qk_layernorm`, as Qwen3) with the targeted linears
    replaced by LoRA linears."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    column, row = lora_linears()
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    attention, mlp = spec.submodules.self_attention, spec.submodules.mlp

    def linear(target: str, plain, cls):
        adapter = adapter_of(lora, target)
        extra = {"lora_fc1": True} if target == "linear_fc1" else {}
        return plain if adapter is None else ModuleSpec(module=cls, params={"lora_adapter": adapter, **extra})

    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, linear_qkv=linear("linear_qkv", attention.submodules.linear_qkv, column),
        linear_proj=linear("linear_proj", attention.submodules.linear_proj, row)))
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(
        mlp.submodules, linear_fc1=linear("linear_fc1", mlp.submodules.linear_fc1, column),
        linear_fc2=linear("linear_fc2", mlp.submodules.linear_fc2, row)))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention,
                                                                    mlp=mlp))


def is_adapter(name: str) -> bool:
    """Whether a (local or global) megatron parameter name is a LoRA adapter's."""
    return name.endswith((f".{A}", f".{B}"))


def freeze_base(model: torch.nn.Module) -> int:
    """Gradients off for every parameter but the adapters'; returns the number of adapter parameters (elements)."""
    trainable = 0
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
        trainable += param.numel() if is_adapter(name) else 0
    if not trainable:
        raise ValueError("model.lora: no adapter on this pipeline stage (is target_modules empty?)")
    return trainable


def init_adapters(model: torch.nn.Module, info: BridgeInfo, pp_rank: int, tp_rank: int, tp: int,
                  seed: int) -> None:
    """A Kaiming-uniform (a = sqrt(5), PEFT's default) from a generator seeded by (seed, global name), this rank's
    slice of it; B zero. Layout independent (module docstring)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(f".{B}"):
                param.zero_()
            elif name.endswith(f".{A}"):
                split = getattr(param, "tensor_model_parallel", False)
                full = torch.empty(param.shape[0], param.shape[1] * (tp if split else 1), dtype=torch.float32)
                key = hashlib.sha256(f"{seed}:{global_name(info, name, pp_rank)}".encode()).digest()
                generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
                torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
                width = param.shape[1]
                part = full[:, tp_rank * width:(tp_rank + 1) * width] if split else full
                param.copy_(part.to(param.dtype))


def global_name(info: BridgeInfo, local: str, pp_rank: int) -> str:
    """The global (layer-resolved) megatron name of stage `pp_rank`'s local parameter name."""
    prefix = "decoder.layers."
    if not local.startswith(prefix):
        return local
    layer, rest = local[len(prefix):].split(".", 1)
    return f"{prefix}{int(layer) + info.first_layer(pp_rank)}.{rest}"


# ---- PEFT layout

def _peft(hf_weight: str, part: str) -> str:
    """`model.layers.0.self_attn.q_proj.weight`, "lora_A" ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    module = hf_weight.removesuffix(".weight")
    return f"{PEFT_PREFIX}{module}.{part}.weight"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SharedA(ParamMapping):
    """A replicated megatron tensor that is the same PEFT tensor under several names (the A that q, k and v, or gate
    and up, share); loading reads the first and requires the others equal."""
    names: tuple[str, ...]

    @property
    def hf_names(self) -> tuple[str, ...]:
        return self.names

    @property
    def tp_sharded(self) -> bool:
        return False

    def load_shard(self, source, tp_rank, tp_size, dims):
        first = source.read(self.names[0])
        for other in self.names[1:]:
            if not torch.equal(source.read(other), first):
                raise ValueError(f"{other} differs from {self.names[0]}: megatron's fused layer has one A for "
                                 f"{', '.join(self.names)} (megatron_bridge.lora)")
        return first

    def merge_shards(self, shards, dims):
        return {name: shards[0] for name in self.names}

    def for_layer(self, layer: int) -> SharedA:
        return dataclasses.replace(super().for_layer(layer),
                                   names=tuple(n.replace("*", str(layer)) for n in self.names))


def _adapter_pair(base: ParamMapping) -> tuple[ParamMapping, ParamMapping]:
    """The (A, B) PEFT mappings of the LoRA on the linear whose weight `base` maps."""
    module = base.megatron.removesuffix(".weight")
    a, b = f"{module}.{A}", f"{module}.{B}"
    if isinstance(base, QKV):
        return (SharedA(megatron=a, names=tuple(_peft(n, "lora_A") for n in base.hf_names)),
                QKV(megatron=b, q=_peft(base.q, "lora_B"), k=_peft(base.k, "lora_B"), v=_peft(base.v, "lora_B")))
    if isinstance(base, GatedMLP):
        return (SharedA(megatron=a, names=tuple(_peft(n, "lora_A") for n in base.hf_names)),
                GatedMLP(megatron=b, gate=_peft(base.gate, "lora_B"), up=_peft(base.up, "lora_B")))
    if isinstance(base, RowParallel):
        return RowParallel(megatron=a, hf=_peft(base.hf, "lora_A")), Replicated(megatron=b, hf=_peft(base.hf, "lora_B"))
    if isinstance(base, ColumnParallel):
        return (Replicated(megatron=a, hf=_peft(base.hf, "lora_A")),
                ColumnParallel(megatron=b, hf=_peft(base.hf, "lora_B")))
    raise TypeError(f"no LoRA layout for a {type(base).__name__} mapping ({base.megatron})")


def adapter_mappings(info: BridgeInfo, lora: LoraConfig) -> list[ParamMapping]:
    """Layer-resolved (A, B) mappings of every adapter `lora` puts on the model, in pipeline order."""
    out: list[ParamMapping] = []
    for mapping in info.resolved_mappings():
        target = mapping.megatron.removesuffix(".weight").rsplit(".", 1)[-1]
        if mapping.megatron.endswith(".weight") and adapter_of(lora, target) is not None:
            out.extend(_adapter_pair(mapping))
    return out


def hf_target_modules(info: BridgeInfo, lora: LoraConfig) -> list[str]:
    """The HF module names (q_proj, ...) PEFT's `target_modules` lists for `lora` on this architecture."""
    names = {name.removesuffix(".lora_A.weight").rsplit(".", 1)[-1]
             for m in adapter_mappings(info, lora) for name in m.hf_names if name.endswith(".lora_A.weight")}
    return sorted(names)


def peft_config(info: BridgeInfo, lora: LoraConfig) -> dict:
    """The adapter_config.json of `lora` on this model (a PEFT LoraConfig as it serialises)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(info.hf_dir),
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": hf_target_modules(info, lora), "bias": "none", "use_rslora": False,
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "modules_to_save": None}


def load_adapter(model: torch.nn.Module, wanted: dict[str, ParamMapping], adapter_dir: str | Path,
                 *, tp_rank: int, tp: int, dims: ModelDims) -> None:
    """Copy a PEFT adapter directory (adapter_model.safetensors) into this rank's adapter shards; `wanted`: local
    adapter parameter name -> its PEFT mapping (this stage's `adapter_mappings`)."""
    params = dict(model.named_parameters())
    with HFCheckpoint(adapter_dir, single_file=ADAPTER_FILE) as source, torch.no_grad():
        for name, mapping in wanted.items():
            shard = mapping.load_shard(source, tp_rank, tp, dims)
            if tuple(shard.shape) != tuple(params[name].shape):
                raise ValueError(f"{adapter_dir}: {mapping.hf_names} give a shard of shape {tuple(shard.shape)}, "
                                 f"{name} is {tuple(params[name].shape)} (another rank, or another model?)")
            params[name].copy_(shard)


class MergedParameters(dict):
    """A stage's parameters by local name, where a LoRA linear's `weight` reads as W + s * B A (this rank's shards:
    exact for both splits, module docstring), computed when asked for: the merged export's input."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model.named_parameters())
        self._adapted = {f"{name}.weight": module for name, module in model.named_modules()
                         if isinstance(module, _LoRA)}

    def __getitem__(self, name: str) -> torch.Tensor:
        module = self._adapted.get(name)
        if module is None:
            return super().__getitem__(name)
        delta = (module.lora_b.float() @ module.lora_a.float()) * module.adapter.scaling
        return (module.weight.float() + delta).to(module.weight.dtype)


@contextlib.contextmanager
def disabled(models: list[torch.nn.Module]):
    """Within the block, every LoRA linear of `models` computes its base layer alone (the adapters' output times
    zero: the same collectives run, so every TP and PP rank must enter it together)."""
    linears = [m for model in models for m in model.modules() if isinstance(m, _LoRA)]
    for linear in linears:
        linear.lora_off = True
    try:
        yield
    finally:
        for linear in linears:
            linear.lora_off = False


def adapter_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    return ((n, p) for n, p in model.named_parameters() if is_adapter(n))
