"""vLLM worker extension: reload weights in place from a directory of safetensors files.

vLLM mixes this class into its worker (`LLM(worker_extension_cls=...)`); `VLLMEngine.load_weights`
calls `rft_reload_weights(path)` on every worker through `llm.collective_rpc`. Only the path string
crosses the process boundary: each worker streams the tensors from disk itself and hands them to
`model_runner.reload_weights(..., is_checkpoint_format=True)`, which runs the model's own checkpoint
loader (renames, QKV / gate-up fusing, TP sharding, and the CPU backend's weight repacking).
vLLM's `weight_transfer` backends (NCCL, CUDA IPC, RDT) need GPUs and a live trainer connection; the
pull path (`rft_reload_weights`) works from a shared filesystem on any device, and the push path
(`rft_join_push_group`, `rft_receive_pushed_weights`; rft.weights.push) receives the trainer's broadcasts in
the worker itself, over gloo on CPU or NCCL on GPU, and feeds them to the same loader.

Tied embeddings: the checkpoint has no `lm_head.weight`, so vLLM's layerwise reload processes only
the embedding and puts the output layer's old kernel tensors back. On the CPU backend the output
layer computes with a copy packed at load time (`dispatch_cpu_unquantized_gemm`), which then keeps
serving the *old* embedding. After a reload of a tied model the output layer is therefore processed
again, from the (shared, now updated) embedding weight. Checked by tests/integration/test_engine.py
against Hugging Face greedy decoding of the reloaded weights.
"""
from __future__ import annotations

import itertools
from typing import Any

from rft.weights.push import PushGroupSpec, PushReceiver, receive_into
from rft.weights.store import PUSHED_ADAPTER_CONFIG, iter_safetensors, save_pushed_adapter


class WeightReloadExtension:
    """Methods added to vLLM's worker. `self.model_runner` is the worker's model runner."""

    rank: int  # the worker's, set by vLLM
    model_runner: Any  # the worker's model runner, set by vLLM
    _rft_push: PushReceiver | None = None  # the push group it is in (rft_join_push_group)

    def rft_reload_weights(self, path: str) -> int:
        """Load every tensor of the safetensors files in `path` into the running model; returns how many."""
        return self._rft_load(iter_safetensors(path))

    def rft_join_push_group(self, spec: dict) -> int:
        """Join the trainer's push group (rft.weights.push); blocks until every member is in. Returns the rank."""
        self._rft_push = PushReceiver.join(PushGroupSpec.from_json(spec))
        return self._rft_push.rank

    def rft_receive_pushed_weights(self, adapter_dir: str = "") -> int:
        """Take part in one pushed version and load it in place; returns the version. A pushed LoRA adapter
        (rft.weights.store.PUSHED_ADAPTER_CONFIG first) is not loaded here: the first worker writes it as a PEFT
        directory into `adapter_dir` (the others drain it) for the engine to load as an adapter."""
        if self._rft_push is None:
            raise RuntimeError("rft_receive_pushed_weights before rft_join_push_group")
        return receive_into(self._rft_push, lambda tensors: self._rft_take(tensors, adapter_dir))

    def _rft_take(self, tensors, adapter_dir: str) -> int:
        tensors = iter(tensors)
        first = next(tensors, None)
        if first is None or first[0] != PUSHED_ADAPTER_CONFIG:
            return self._rft_load(itertools.chain([first] if first is not None else [], tensors))
        if not adapter_dir:
            raise RuntimeError("a LoRA adapter was pushed to an engine started without LoRA (model.lora.rank 0)")
        if self.rank == 0:
            return save_pushed_adapter(first, tensors, adapter_dir)
        return sum(1 for _ in tensors)

    def rft_leave_push_group(self) -> None:
        push = getattr(self, "_rft_push", None)
        if push is not None:
            push.close()
        self._rft_push = None

    def _rft_load(self, tensors) -> int:
        count = 0

        def counted():
            nonlocal count
            for item in tensors:
                count += 1
                yield item

        self.model_runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        self._reprocess_tied_output_layer()
        return count

    def _reprocess_tied_output_layer(self) -> None:
        hf_config = self.model_runner.model_config.hf_text_config
        lm_head = getattr(self.model_runner.get_model(), "lm_head", None)
        quant_method = getattr(lm_head, "quant_method", None)
        if getattr(hf_config, "tie_word_embeddings", False) and quant_method is not None:
            quant_method.process_weights_after_loading(lm_head)
