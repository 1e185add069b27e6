"""megatron_bridge: Hugging Face <-> megatron-core, with tensor and pipeline parallelism, on GPU (nccl)
and on CPU (gloo, through the `megatron_bridge.device` shim). The only package of rft that imports
`megatron.core` (lazily: importing megatron_bridge itself is cheap).

Public API:
- `parallel.initialize(tp, pp, seed=)` / `parallel.destroy()` / `parallel.layout()`: process groups.
- `build_model(hf_dir, dtype=)` -> [GPTModel]: this rank's TP/PP shard, weights read from safetensors.
- `iter_hf_buckets(models, bucket_bytes)`, `save_hf(models, out_dir)`: export back to HF, bucketed.
- `MegatronPolicy`: the trainer's model (train_step with an entropy metric, forward_logprobs, a frozen
  reference model with reference_logprobs, export, dist checkpoints).
- `bridge_for(hf_config)`, `register(hf_class_name)`: the architecture registry (Qwen2, Llama).
- `python -m megatron_bridge.check HF_DIR --tp T --pp P`: verify logits and the round trip on a model.
"""
import importlib

# name -> the module that defines it, imported at the first use of the name (PEP 562), so that a config check
# importing megatron_bridge.layout or megatron_bridge.models does not import torch and megatron-core with the package
_API = {"iter_hf_buckets": "export", "save_hf": "export", "build_model": "model", "load_hf_weights": "model",
        "UnsupportedModelError": "models", "bridge_for": "models", "register": "models", "MegatronPolicy": "policy"}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'megatron_bridge' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megatron_bridge.{_API[name]}"), name)
