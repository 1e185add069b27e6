"""Recording an MoE model's routing during generation, for routing replay (rft.schema.RoutedExperts).

`RoutingRecorder` hooks the top-k routers of a Hugging Face MoE model (transformers' `*TopKRouter` modules: Qwen3-MoE,
Qwen2-MoE, Mixtral, DeepSeek-V3 return `(router_logits, scores, indices)`) and keeps the `indices` each forward pass
used: exactly the experts the model computed with, not a re-derivation from logits. `routed_experts` cuts one
completion's share out of a recorded `generate` call.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from rft.engine.base import EngineError
from rft.models.moe import read_moe_shape
from rft.schema import RoutedExperts

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RoutingRecorder:
    """Forward hooks on every top-k router of `model` (in decoder-layer order) while `recording()` is open.

    Contract of one recording: the hooked forward passes are those of one `generate` call on a batch of `batch`
    sequences of equal length (a prompt repeated n times: HF's `num_return_sequences`), a prefill of P positions
    then one position per decoding step; each router's output indices are [batch x positions, top_k] in batch-major
    order. Not thread-safe (one model, one generate at a time)."""

    def __init__(self, model):
        self.routers = sorted(((int(_LAYER.search(name).group(1)), module) for name, module in model.named_modules()
                               if type(module).__name__.lower().endswith("topkrouter") and _LAYER.search(name)),
                              key=lambda item: item[0])
        if not self.routers:
            raise EngineError(f"routing replay needs a mixture-of-experts model; {type(model).__name__} has no top-k "
                              "router (a *TopKRouter module inside model.layers.N)")
        self.layers = [layer for layer, _ in self.routers]
        first = self.routers[0][1]
        self.num_experts, self.top_k = int(first.num_experts), int(first.top_k)
        self._calls: list[list] = []

    @contextmanager
    def recording(self) -> Iterator[RoutingRecorder]:
        """Record the routers' indices of every forward pass inside the block (earlier records are dropped)."""
        self._calls = [[] for _ in self.routers]
        handles = [module.register_forward_hook(self._hook(i)) for i, (_, module) in enumerate(self.routers)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, index: int):
        def keep(module, inputs, output):
            self._calls[index].append(output[2].detach().to("cpu"))
        return keep

    def positions(self, batch: int) -> np.ndarray:
        """The recording as [batch, positions, layers, top_k] int64: forward passes concatenated along positions."""
        import torch

        per_layer = []
        for layer, calls in zip(self.layers, self._calls, strict=True):
            if not calls:
                raise EngineError(f"routing recorder: MoE layer {layer} saw no forward pass")
            per_layer.append(torch.cat([c.reshape(batch, -1, self.top_k) for c in calls], dim=1))
        return torch.stack(per_layer, dim=2).numpy()

    def routed_experts(self, recorded: np.ndarray, row: int, n_inputs: int, first_position: int = 0
                       ) -> RoutedExperts:
        """Sequence `row`'s input positions `first_position`..`n_inputs` - 1 (of prompt + response - 1) of
        `positions()`: `first_position` 0 keeps the prompt's prefill, P - 1 only the passes that produced tokens."""
        if recorded.shape[1] < n_inputs:
            raise EngineError(f"routing recorder: {recorded.shape[1]} positions recorded, the completion needs "
                              f"{n_inputs}")
        first = first_recorded(first_position, n_inputs)
        ids = recorded[row, first:n_inputs].astype(RoutedExperts.dtype_for(self.num_experts))
        return RoutedExperts(ids=ids, num_experts=self.num_experts, layers=list(self.layers), first_position=first)


def first_recorded(first_position: int, n_inputs: int) -> int:
    """The first input position a record keeps: `first_position` (0: the prefill too; P - 1: the last prompt
    position), never past `n_inputs` (an empty response keeps nothing)."""
    return max(0, min(first_position, n_inputs))


class MoELayout:
    """Which decoder layers of a Hugging Face MoE config route (`layers`), over how many experts, top-k; and the
    conversion of an engine's raw routed-experts array into a `RoutedExperts` record (vLLM's output)."""

    def __init__(self, layers: list[int], num_experts: int, top_k: int, num_hidden_layers: int):
        self.layers, self.num_experts, self.top_k = layers, num_experts, top_k
        self.num_hidden_layers = num_hidden_layers

    @classmethod
    def of(cls, model_dir) -> MoELayout:
        """From `config.json` (rft.models.moe: Qwen2/3-MoE keys `num_experts`, `num_experts_per_tok`,
        `decoder_sparse_step`, `mlp_only_layers`); EngineError for a config without experts."""
        shape = read_moe_shape(model_dir)
        if shape is None:
            raise EngineError(f"routing replay needs a mixture-of-experts model; {model_dir}/config.json names no "
                              "experts (num_experts)")
        return cls(list(shape.layers), shape.num_experts, shape.top_k, shape.num_hidden_layers)

    def routed(self, raw, n_inputs: int, first_position: int = 0) -> RoutedExperts:
        """`raw`: [positions, layers, top_k] ids as an engine returned them, its layer axis over either every decoder
        layer or only the MoE ones; positions `first_position`..`n_inputs` - 1 become the record (EngineError
        otherwise)."""
        if raw is None:
            raise EngineError("routing replay: the engine returned no routed experts for a completion")
        ids = np.asarray(raw)
        if ids.ndim != 3 or ids.shape[2] != self.top_k or ids.shape[0] < n_inputs \
                or ids.shape[1] not in (len(self.layers), self.num_hidden_layers):
            raise EngineError(f"routing replay: routed experts of shape {ids.shape}, expected [>= {n_inputs} "
                              f"positions, {len(self.layers)} MoE layers (or {self.num_hidden_layers} layers), "
                              f"top_k {self.top_k}]")
        if ids.shape[1] != len(self.layers):
            ids = ids[:, self.layers]
        first = first_recorded(first_position, n_inputs)
        return RoutedExperts(ids=ids[first:n_inputs].astype(RoutedExperts.dtype_for(self.num_experts)),
                             num_experts=self.num_experts, layers=list(self.layers), first_position=first)
