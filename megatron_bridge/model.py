"""Build a TP/PP-sharded megatron GPTModel from an HF directory and load its safetensors into it.

`build_model(hf_dir, dtype=...)` needs `megatron_bridge.parallel.initialize(tp, pp)` first and
returns `[GPTModel]` (a list of model chunks, as megatron's schedules take; one chunk per rank, no
virtual pipeline). Each rank builds only its pipeline stage and reads only its own slices of the HF
tensors. The returned model carries a `BridgeInfo` (attribute `bridge_info`) so export and the policy
know the architecture without re-reading the config.

Layer spec: Transformer Engine's when `transformer_engine` is importable and a GPU is present,
megatron's local spec otherwise. The mapping tables use local-spec names; `TE_NAMES` renames the
two norms TE fuses into the following linear layer.
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import megatron_bridge.device as device
import megatron_bridge.lora as adapters
import megatron_bridge.parallel as parallel
from megatron_bridge.hf_checkpoint import HFCheckpoint
from megatron_bridge.mapping import ModelDims, ParamMapping
from megatron_bridge.models import DecoderBridge, bridge_for
from megatron_bridge.models.base import OUTPUT_LAYER

if TYPE_CHECKING:
    from rft.config import LoraConfig

TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
EMBEDDING = "embedding.word_embeddings.weight"
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class BridgeInfo:
    """What export and the policy need to know about a built model."""

    hf_dir: Path
    bridge: DecoderBridge
    dims: ModelDims
    transformer_engine: bool
    pp: int

    @property
    def layers_per_stage(self) -> int:
        return self.dims.num_layers // self.pp

    def owner_stage(self, megatron_name: str) -> int:
        """Pipeline stage holding a global (layer-resolved) megatron parameter."""
        match = _LAYER_NAME.fullmatch(megatron_name)
        if match:
            return int(match.group(1)) // self.layers_per_stage
        return 0 if megatron_name == EMBEDDING else self.pp - 1

    def resolved_mappings(self) -> list[ParamMapping]:
        """Every mapping with its layer index filled in, in pipeline order: the first stage's global
        parameters (embedding), layers 0..L-1, then the last stage's (final norm, output layer)."""
        mappings = self.bridge.mappings()
        first = [m for m in mappings if not m.per_layer and self.owner_stage(m.megatron) == 0]
        layers = [m.for_layer(i) for i in range(self.dims.num_layers) for m in mappings if m.per_layer]
        last = [m for m in mappings if not m.per_layer and self.owner_stage(m.megatron) != 0]
        return first + layers + last

    def local_name(self, megatron_name: str, pp_rank: int) -> str:
        """The parameter name in this stage's module for a global (layer-resolved) megatron name."""
        match = _LAYER_NAME.fullmatch(megatron_name)
        if not match:
            return megatron_name
        layer, rest = int(match.group(1)), match.group(2)
        if self.transformer_engine:
            rest = TE_NAMES.get(rest, rest)
        return f"decoder.layers.{layer - pp_rank * self.layers_per_stage}.{rest}"


def uses_transformer_engine() -> bool:
    return device.gpu_available() and importlib.util.find_spec("transformer_engine") is not None


def load_hf_config(hf_dir: str | Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(hf_dir))


def _layer_spec(transformer_engine: bool):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    if transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec(normalization="RMSNorm")


def build_model(hf_dir: str | Path, *, dtype: str | torch.dtype = "float32", load_weights: bool = True,
                lora: "LoraConfig | None" = None, seed: int = 0):
    """This rank's pipeline stage of the HF model as `[GPTModel]`, weights loaded from `hf_dir`.

    `lora` with a rank > 0: LoRA adapters on its target linears (megatron_bridge.lora; always megatron's local
    spec), initialised from `seed` or loaded from `lora.init_from`, and every other parameter frozen."""
    from megatron.core.models.gpt import GPTModel

    hf_dir = Path(hf_dir)
    bridge = bridge_for(load_hf_config(hf_dir))
    where = parallel.layout()
    lora = lora if lora is not None and lora.rank else None
    te = uses_transformer_engine() and lora is None
    config = bridge.transformer_config(tp=where.tp, pp=where.pp, dtype=dtype, on_cpu=device.is_installed())
    spec = adapters.layer_spec(lora) if lora is not None else _layer_spec(te)
    model = GPTModel(config=config, transformer_layer_spec=spec, pre_process=where.is_first_stage,
                     post_process=where.is_last_stage, **bridge.gpt_model_kwargs(where.tp))
    if not device.is_installed():
        model.cuda(torch.cuda.current_device())
    # megatron's local-spec norms ignore params_dtype; megatron-LM casts the whole model the same way
    # (its Float16Module) for 16-bit training
    model.to(dtype=config.params_dtype)
    model.bridge_info = BridgeInfo(hf_dir=hf_dir, bridge=bridge, dims=bridge.dims(where.tp),
                                   transformer_engine=te, pp=where.pp)
    if load_weights:
        load_hf_weights([model], hf_dir)
    if lora is not None:
        adapters.freeze_base(model)
        if lora.init_from:
            wanted = local_mappings_of(model.bridge_info, adapters.adapter_mappings(model.bridge_info, lora),
                                       where.pp_rank)
            adapters.load_adapter(model, wanted, lora.init_from, tp_rank=where.tp_rank, tp=where.tp,
                                  dims=model.bridge_info.dims)
        else:
            adapters.init_adapters(model, model.bridge_info, where.pp_rank, where.tp_rank, where.tp, seed)
    return [model]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    while not hasattr(model, "bridge_info") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "bridge_info"):
        raise TypeError(f"{type(model).__name__} was not built by megatron_bridge.build_model")
    return model


def local_mappings(info: BridgeInfo, pp_rank: int) -> dict[str, ParamMapping]:
    """Local parameter name -> resolved mapping, for every mapped parameter of stage `pp_rank`."""
    return local_mappings_of(info, info.resolved_mappings(), pp_rank)


def local_mappings_of(info: BridgeInfo, mappings: list[ParamMapping], pp_rank: int) -> dict[str, ParamMapping]:
    """Local parameter name -> mapping, for those of the resolved `mappings` that stage `pp_rank` holds."""
    return {info.local_name(m.megatron, pp_rank): m for m in mappings if info.owner_stage(m.megatron) == pp_rank}


def load_hf_weights(models: list[torch.nn.Module], hf_dir: str | Path) -> None:
    """Copy the HF safetensors of `hf_dir` into this rank's shards; every parameter must be covered."""
    where = parallel.layout()
    model = unwrap(models[0])
    info: BridgeInfo = model.bridge_info
    wanted = local_mappings(info, where.pp_rank)
    embedding = next(m for m in info.bridge.mappings() if m.megatron == EMBEDDING)
    params = {n: p for n, p in model.named_parameters() if not adapters.is_adapter(n)}
    missing = sorted(set(wanted) - set(params))
    if missing:
        raise KeyError(f"{info.bridge.hf_class} mapping names megatron parameters this stage lacks: {missing}")
    with HFCheckpoint(hf_dir) as source, torch.no_grad():
        for name, param in params.items():
            mapping = wanted.get(name)
            if mapping is None and name == OUTPUT_LAYER and info.bridge.tied_embeddings:
                mapping = embedding  # the last stage's copy of the tied embedding (pp > 1)
            if mapping is None:
                raise KeyError(f"megatron parameter {name!r} has no mapping in the {info.bridge.hf_class} table")
            shard = mapping.load_shard(source, where.tp_rank, where.tp, info.dims)
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(f"{name}: HF {mapping.hf_names} give a shard of shape {tuple(shard.shape)}, "
                                 f"megatron expects {tuple(param.shape)}")
            param.data.copy_(shard)
