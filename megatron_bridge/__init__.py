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
from megatron_bridge.export import iter_hf_buckets, save_hf
from megatron_bridge.model import build_model, load_hf_weights
from megatron_bridge.models import UnsupportedModelError, bridge_for, register
from megatron_bridge.policy import MegatronPolicy

__all__ = ["MegatronPolicy", "UnsupportedModelError", "bridge_for", "build_model", "iter_hf_buckets",
           "load_hf_weights", "register", "save_hf"]
