"""PEFT adapters for the LoRA tests, made with the `peft` library itself (the independent reference)."""
from __future__ import annotations

from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHARED = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # megatron fuses these: one A


def make_peft_adapter(model_dir: Path, out: Path, *, rank: int, alpha: float, seed: int, scale: float = 1.0) -> Path:
    """A PEFT adapter on `model_dir` with random A and B (peft's `init_lora_weights=False`; B times `scale`), A
    shared where megatron fuses the projections (SHARED), as megatron_bridge.lora can represent it. Returns `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, init_lora_weights=False))
    with torch.no_grad():
        for layer in model.base_model.model.model.layers:
            modules = {**{n: getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
                       **{n: getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")}}
            for name, source in SHARED.items():
                modules[name].lora_A["default"].weight.copy_(modules[source].lora_A["default"].weight)
            for module in modules.values():
                module.lora_B["default"].weight.mul_(scale)
    model.save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path):
    """The HF model at `base` with the PEFT adapter at `adapter` (peft's loader), float32, eval mode."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
