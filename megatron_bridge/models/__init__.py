"""Architecture bridges, registered by HF class name. Importing this package registers them all."""
from megatron_bridge.models import idefics3, llama, qwen2, qwen2_5_vl, qwen2_moe, qwen3, qwen3_moe  # noqa: F401  (registration side effect)
from megatron_bridge.models.base import (
    DecoderBridge,
    UnsupportedModelError,
    bridge_for,
    padded_vocab_size,
    register,
    registered_architectures,
)

__all__ = ["DecoderBridge", "UnsupportedModelError", "bridge_for", "padded_vocab_size", "register",
           "registered_architectures"]
