"""What a built model is, as export, LoRA and the policy need to know it (`BridgeInfo`, the `bridge_info` attribute
`megatron_bridge.model.build_model` sets): the architecture's bridge, the dimensions, the pipeline stages' layers and
the expert-parallel split, and how a global megatron parameter name maps to a stage's local one."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from megatron_bridge.mapping import ModelDims, ParamMapping
from megatron_bridge.models import DecoderBridge
from megatron_bridge.models.base import stage_layer_counts

TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
EMBEDDING = "embedding.word_embeddings.weight"
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT_NAME = re.compile(r"(mlp\.experts\.local_experts\.)(\d+)(\..+)")


@dataclass(frozen=True)
class BridgeInfo:
    """What export and the policy need to know about a built model. `stage_layers`: decoder layers per
    pipeline stage, first to last; `ep`: expert-parallel ranks sharing each layer's experts (1 when dense)."""

    hf_dir: Path
    bridge: DecoderBridge
    dims: ModelDims
    transformer_engine: bool
    pp: int
    stage_layers: tuple[int, ...] = ()
    ep: int = 1

    def __post_init__(self):
        if not self.stage_layers:
            object.__setattr__(self, "stage_layers", stage_layer_counts(self.dims.num_layers, self.pp, None))

    def first_layer(self, stage: int) -> int:
        """Global index of stage `stage`'s first decoder layer."""
        return sum(self.stage_layers[:stage])

    @property
    def experts_per_rank(self) -> int:
        return self.bridge.num_experts // self.ep

    def owner_stage(self, megatron_name: str) -> int:
        """Pipeline stage holding a global (layer-resolved) megatron parameter."""
        match = _LAYER_NAME.fullmatch(megatron_name)
        if match:
            layer, stage = int(match.group(1)), 0
            while layer >= self.first_layer(stage + 1):
                stage += 1
            return stage
        return 0 if megatron_name == EMBEDDING or self.bridge.on_first_stage(megatron_name) else self.pp - 1

    def owner_ep_rank(self, megatron_name: str) -> int | None:
        """Expert-parallel rank holding a global (expert-resolved) routed expert's weight; None for every
        other parameter (held by all expert-parallel ranks)."""
        match = _EXPERT_NAME.search(megatron_name)
        return int(match.group(2)) // self.experts_per_rank if match else None

    def resolved_mappings(self) -> list[ParamMapping]:
        """Every mapping with its layer (and expert) index filled in, in pipeline order: the first stage's
        global parameters (embedding), layers 0..L-1 (a layer's routed experts in expert order), then the last
        stage's (final norm, output layer)."""
        mappings = self.bridge.mappings()
        first = [m for m in mappings if not m.per_layer and self.owner_stage(m.megatron) == 0]
        layers = [resolved for i in range(self.dims.num_layers) for m in self.bridge.layer_mappings(i)
                  for resolved in self._for_experts(m.for_layer(i))]
        last = [m for m in mappings if not m.per_layer and self.owner_stage(m.megatron) != 0]
        return first + layers + last

    def _for_experts(self, mapping: ParamMapping) -> list[ParamMapping]:
        if not mapping.per_expert:
            return [mapping]
        return [mapping.for_expert(e) for e in range(self.bridge.num_experts)]

    def local_name(self, megatron_name: str, pp_rank: int, ep_rank: int = 0) -> str:
        """The parameter name in this stage's (and expert-parallel rank's) module for a global (layer- and
        expert-resolved) megatron name."""
        match = _LAYER_NAME.fullmatch(megatron_name)
        if not match:
            return megatron_name
        layer, rest = int(match.group(1)), match.group(2)
        if self.transformer_engine and not self.bridge.is_moe_layer(layer):  # a MoE layer keeps its own norm
            rest = TE_NAMES.get(rest, rest)
        expert = _EXPERT_NAME.fullmatch(rest)
        if expert:
            local = int(expert.group(2)) - ep_rank * self.experts_per_rank
            rest = f"{expert.group(1)}{local}{expert.group(3)}"
        return f"decoder.layers.{layer - self.first_layer(pp_rank)}.{rest}"

    def holds(self, megatron_name: str, pp_rank: int, ep_rank: int) -> bool:
        """Whether the rank at (pp_rank, ep_rank) holds a global megatron parameter."""
        owner_ep = self.owner_ep_rank(megatron_name)
        return self.owner_stage(megatron_name) == pp_rank and owner_ep in (None, ep_rank)
