"""Which decoder layers of a Hugging Face mixture-of-experts config route tokens, over how many experts, top-k: read
from `config.json` as transformers' Qwen3-MoE / Qwen2-MoE (and Mixtral's `num_local_experts`) define it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class MoEShape:
    """`layers`: the 0-based decoder indices of the MoE layers; `num_experts` routed experts each, `top_k` per token;
    `num_hidden_layers`: every decoder layer."""
    layers: tuple[int, ...]
    num_experts: int
    top_k: int
    num_hidden_layers: int


def moe_shape(config: dict[str, Any]) -> MoEShape | None:
    """The MoE layers of a parsed `config.json`, None for a model without experts. A layer routes unless it is in
    `mlp_only_layers` or `(layer + 1) % decoder_sparse_step != 0` (transformers' Qwen2-MoE / Qwen3-MoE rule)."""
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if not experts:
        return None
    n, step = int(config["num_hidden_layers"]), int(config.get("decoder_sparse_step", 1) or 1)
    dense = set(config.get("mlp_only_layers") or [])
    layers = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
    return MoEShape(layers, experts, int(config["num_experts_per_tok"]), n)


def read_moe_shape(model_dir: str | Path) -> MoEShape | None:
    """`moe_shape` of `model_dir/config.json` (OSError, ValueError when it is missing or not JSON)."""
    return moe_shape(json.loads((Path(model_dir) / "config.json").read_text()))
