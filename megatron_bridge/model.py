"""Build a TP/PP-sharded megatron GPTModel from an HF directory and load its safetensors into it.

`build_model(hf_dir, dtype=...)` needs `megatron_bridge.parallel.initialize(tp, pp, ep=)` first and returns `[GPTModel]`
(a list of model chunks, as megatron's schedules take; one chunk per rank, no virtual pipeline). Each rank builds only
its pipeline stage (an even split of the layers, or the `pp_layers` given) and, in a mixture of experts, only its
expert-parallel rank's experts, and reads only its own slices of the HF tensors. The returned model carries a
`BridgeInfo` (attribute `bridge_info`) so export and the policy know the architecture without re-reading the config.

Layer spec: Transformer Engine's when `transformer_engine` is importable and a GPU is present, megatron's local spec
otherwise; a mixture of experts gets megatron's decoder block spec (dense and MoE layers by the config's
`moe_layer_freq`), with SequentialMLP experts (no grouped GEMM). TE fuses the MLP's norm into fc1 only in dense layers:
a MoE layer keeps `pre_mlp_layernorm`. The mapping tables use local-spec names; `TE_NAMES` renames the two norms TE
fuses into the following linear layer.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import megatron_bridge.device as device
import megatron_bridge.lora as adapters
import megatron_bridge.parallel as parallel
from megatron_bridge.hf_checkpoint import HFCheckpoint
from megatron_bridge.info import EMBEDDING, BridgeInfo
from megatron_bridge.mapping import ParamMapping
from megatron_bridge.models import bridge_for
from megatron_bridge.models.base import OUTPUT_LAYER, stage_layer_counts

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from rft.models.config import LoraConfig



def uses_transformer_engine() -> bool:
    return device.gpu_available() and importlib.util.find_spec("transformer_engine") is not None


def load_hf_config(hf_dir: str | Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(hf_dir))


def _layer_spec(transformer_engine: bool, config, pp_rank: int):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    if config.num_moe_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=transformer_engine,
                                          normalization="RMSNorm", pp_rank=pp_rank)
    elif transformer_engine:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    if config.sequence_parallel and not transformer_engine:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        spec = _replace_module(spec, WrappedTorchNorm, SequenceParallelRMSNorm)
    return spec


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, as megatron's local spec builds it (`WrappedTorchNorm`), for sequence parallelism,
    which `WrappedTorchNorm` refuses: under it each TP rank normalises its own slice of the sequence, so the
    weight is marked `sequence_parallel` and megatron's `finalize_model_grads` sums its gradient over TP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm with normalization={config.normalization!r}")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # megatron's mark


def _replace_module(spec, old: type, new: type):
    """A copy of a megatron ModuleSpec tree (specs, submodule dataclasses, lists) with `old` replaced by `new`."""
    import dataclasses

    if spec is old:
        return new
    if isinstance(spec, list):
        return [_replace_module(s, old, new) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: _replace_module(getattr(spec, f.name), old, new)
                                            for f in dataclasses.fields(spec) if f.init})
    return spec


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16.1's MoE router calls `moe_utils.te_general_gemm` when it is not None, but leaves the
    name undefined (NameError) when Transformer Engine is not installed; define it as None there, which selects
    its plain torch matmul."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _mark_experts_expert_parallel(model: torch.nn.Module) -> None:
    """Mark the routed experts' weights expert-parallel (`allreduce=False`) at every EP size, as megatron does only
    for EP > 1: its optimizer then always keeps them in a second optimizer (a ChainedOptimizer of dense and expert
    weights), so a checkpoint's optimizer state has the same structure at EP 1 and EP > 1 and reshards across EP
    sizes. At EP 1 the expert data-parallel group is the data-parallel group: gradients are reduced the same."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False  # type: ignore[attr-defined]  # megatron's mark on a Parameter


def build_model(hf_dir: str | Path, *, dtype: str | torch.dtype = "float32", load_weights: bool = True,
                pp_layers: tuple[int, ...] | None = None, aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                lora: LoraConfig | None = None, seed: int = 0):
    """This rank's pipeline stage of the HF model as `[GPTModel]`, weights loaded from `hf_dir`.

    `pp_layers`: decoder layers per pipeline stage for an uneven split (None: even). `aux_loss_coeff`,
    `z_loss_coeff`: a mixture of experts' load-balancing and router z-loss coefficients (0: off). `lora` with a
    rank > 0: LoRA adapters on its target linears (megatron_bridge.lora; always megatron's local spec, dense
    models only), initialised from `seed` or loaded from `lora.init_from`, and every other parameter frozen."""
    hf_dir = Path(hf_dir)
    bridge = bridge_for(load_hf_config(hf_dir))
    where = parallel.layout()
    lora = lora if lora is not None and lora.rank else None
    te = uses_transformer_engine() and lora is None
    config = bridge.transformer_config(tp=where.tp, pp=where.pp, ep=where.ep, pp_layers=pp_layers, dtype=dtype,
                                       on_cpu=device.is_installed(), aux_loss_coeff=aux_loss_coeff,
                                       z_loss_coeff=z_loss_coeff)
    if lora is not None and bridge.first_stage_prefixes:
        raise ValueError(f"model.lora: LoRA on a vision-language model ({bridge.hf_class}) is not supported; set "
                         "model.lora.rank 0")
    if config.num_moe_experts:
        if lora is not None:
            raise ValueError(f"model.lora: LoRA on a mixture of experts ({bridge.hf_class}) is not supported: "
                             "adapters go on dense linears only; set model.lora.rank 0")
        _define_missing_te_gemm()
    spec = (adapters.layer_spec(lora, qk_layernorm=config.qk_layernorm) if lora is not None
            else _layer_spec(te, config, where.pp_rank))
    model = bridge.build_model(config=config, spec=spec, pre_process=where.is_first_stage,
                               post_process=where.is_last_stage, tp=where.tp)
    if not device.is_installed():
        model.cuda(torch.cuda.current_device())
    # megatron's local-spec norms ignore params_dtype; megatron-LM casts the whole model the same way
    # (its Float16Module) for 16-bit training
    model.to(dtype=config.params_dtype)
    if config.num_moe_experts:
        _mark_experts_expert_parallel(model)
    model.bridge_info = BridgeInfo(hf_dir=hf_dir, bridge=bridge, dims=bridge.dims(where.tp), transformer_engine=te,
                                   pp=where.pp, ep=where.ep,
                                   stage_layers=stage_layer_counts(bridge.hf.num_hidden_layers, where.pp, pp_layers))
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


def unwrap(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    while not hasattr(model, "bridge_info") and hasattr(model, "module"):
        inner = model.module
        assert isinstance(inner, torch.nn.Module)  # what megatron's wrappers wrap
        model = inner
    if not hasattr(model, "bridge_info"):
        raise TypeError(f"{type(model).__name__} was not built by megatron_bridge.build_model")
    return model


def config_of(chunk: torch.nn.Module) -> TransformerConfig:
    """megatron's TransformerConfig of a model chunk: a GPTModel or a megatron wrapper of one (DDP, Float16Module),
    each a MegatronModule, which keeps it as `config`."""
    return chunk.config


def local_mappings(info: BridgeInfo, pp_rank: int, ep_rank: int = 0) -> dict[str, ParamMapping]:
    """Local parameter name -> resolved mapping, for every mapped parameter of stage `pp_rank` held by
    expert-parallel rank `ep_rank`."""
    return local_mappings_of(info, info.resolved_mappings(), pp_rank, ep_rank)


def local_mappings_of(info: BridgeInfo, mappings: list[ParamMapping], pp_rank: int,
                      ep_rank: int = 0) -> dict[str, ParamMapping]:
    """Local parameter name -> mapping, for those of the resolved `mappings` that the rank at (pp_rank, ep_rank)
    holds."""
    return {info.local_name(m.megatron, pp_rank, ep_rank): m for m in mappings
            if info.holds(m.megatron, pp_rank, ep_rank)}


def load_hf_weights(models: list[torch.nn.Module], hf_dir: str | Path) -> None:
    """Copy the HF safetensors of `hf_dir` into this rank's shards; every parameter must be covered."""
    where = parallel.layout()
    model = unwrap(models[0])
    info: BridgeInfo = model.bridge_info
    wanted = local_mappings(info, where.pp_rank, where.ep_rank)
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
