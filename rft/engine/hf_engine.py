"""`TransformersEngine`: Hugging Face `generate` in this process, the independent reference for tests and
`rft bench generate`, and a slow fallback (`explorer.engine: transformers`)."""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from rft.engine.base import Completion, EngineError, Generation, ImagePrompt, SamplingSettings, TokenizerMixin
from rft.engine.routing import RoutingRecorder
from rft.models.vision import VisionError, is_vision_model, load_processor, process_prompt
from rft.schema import RoutedExperts
from rft.weights.store import (
    PUSHED_ADAPTER_CONFIG,
    is_adapter_version,
    iter_safetensors,
    read_adapter,
    save_pushed_adapter,
)

if TYPE_CHECKING:
    from rft.explorer.config import ExplorerConfig
    from rft.models.config import ModelConfig
    from rft.weights.push import PushReceiver

log = logging.getLogger(__name__)
# from this many new tokens on, generate into a static KV cache allocated once at full length: the dynamic cache
# concatenates every layer's keys and values at each step, O(n^2) bytes copied (16k tokens x 3 rows of a tiny MoE:
# 2-4x the time, and glibc keeps the freed buffers resident, 5.9 GB against 0.5 GB)
STATIC_CACHE_FROM = 1024

class TransformersEngine(TokenizerMixin):
    """HF `generate` in this process, one prompt at a time with `num_return_sequences=n` (prompts of
    different lengths need no padding that way). Reference implementation, not a fast path."""

    def __init__(self, model_path: str | os.PathLike, *, dtype: str = "float32", seed: int = 0,
                 weights_version: int = 0, device: str = "cpu", chat_template: bool = False,
                 record_routing: bool = False, routing_prefill: bool = False):
        """`record_routing`: every completion carries `routed_experts`, the experts each MoE layer routed its
        tokens to (rft.engine.routing; EngineError for a model without top-k routers): from the last prompt position
        (the passes that produced response tokens), or from the first with `routing_prefill`."""
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        self.torch = torch
        # a vision-language model (rft.models.vision): its processor, whose tokenizer is the model's
        self.processor: Any = load_processor(model_path) if is_vision_model(model_path) else None
        self.tokenizer = (self.processor.tokenizer if self.processor is not None
                          else AutoTokenizer.from_pretrained(str(model_path)))
        auto = AutoModelForImageTextToText if self.processor is not None else AutoModelForCausalLM
        model = auto.from_pretrained(str(model_path), dtype=getattr(torch, dtype))
        self.model = model.to(device)  # type: ignore[arg-type]  # transformers types `to` as a PreTrainedModel method
        self.model.eval()
        self._stop_at_end_of_turn(chat_template)
        self.stops = set(self.stop_token_ids) | {self.tokenizer.eos_token_id} - {None}
        self.device = device
        self.generator_seed = seed
        self.weights_version = weights_version
        self.routing = RoutingRecorder(self.model) if record_routing else None
        self.routing_prefill = routing_prefill
        self._base_weights: dict = {}  # HF module name -> its weight before the first adapter merged into it
        self._push: PushReceiver | None = None  # the push group it is in (join_push_group)
        torch.manual_seed(seed)

    @classmethod
    def from_config(cls, explorer: ExplorerConfig, model: ModelConfig, *, seed: int,
                    model_path: str | None = None, record_routing: bool = False,
                    routing_prefill: bool = False) -> TransformersEngine:
        """The engine the model section describes, on `model_path` (default `model.path`)."""
        import torch

        return cls(model_path or model.path, dtype=model.dtype, seed=seed, chat_template=model.chat_template,
                   device="cuda" if torch.cuda.is_available() else "cpu", record_routing=record_routing,
                   routing_prefill=routing_prefill)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[Generation]:
        return [self._generate_one(list(p), sampling) for p in prompts]

    def generate_images(self, prompts: Sequence[ImagePrompt], sampling: SamplingSettings) -> list[Generation]:
        """Each prompt's placeholders expanded by the processor (rft.models.vision.process_prompt, or the prompt's
        `processed` when its maker already ran it), generated with its pixel tensors (each Generation's
        `prompt_text` the prompt's text); EngineError for a text-only model or a prompt the processor refuses."""
        if self.processor is None:
            raise EngineError("generate_images needs a vision-language model; this one has no vision_config")
        generations = []
        for p in prompts:
            try:
                processed = p.processed if p.processed is not None else process_prompt(self.processor, p.text,
                                                                                        p.images)
            except VisionError as e:
                raise EngineError(str(e)) from None
            pixels = {k: v.to(self.device) for k, v in processed.pixels.items()}
            if "pixel_values" in pixels:
                pixels["pixel_values"] = pixels["pixel_values"].to(self.model.dtype)
            if "image_grid_thw" in pixels:  # Qwen-VL: transformers builds MRoPE positions only from token types
                ids = self.torch.tensor([processed.token_ids], device=self.device)
                pixels["mm_token_type_ids"] = (ids == self.processor.image_token_id).to(self.torch.int32)
            generation = self._generate_one(processed.token_ids, sampling, pixels)
            generation.prompt_text = p.text
            generations.append(generation)
        return generations

    def _generate_one(self, prompt: list[int], sampling: SamplingSettings,
                      pixels: dict[str, Any] | None = None) -> Generation:
        """`pixels`: an image prompt's tensors (rft.models.vision.ProcessedPrompt.pixels), passed to `generate`."""
        torch = self.torch
        ids = torch.tensor([prompt], device=self.device)
        greedy = sampling.temperature == 0
        sample_args: dict[str, Any] = {} if greedy else dict(temperature=sampling.temperature, top_p=sampling.top_p,
                                                               top_k=0)
        if self.stop_token_ids:
            sample_args["eos_token_id"] = sorted(self.stops)
        if sampling.max_tokens >= STATIC_CACHE_FROM:
            sample_args["cache_implementation"] = "static"
        rows = 1 if greedy else sampling.n
        routing = self.routing
        with torch.no_grad(), (routing.recording() if routing else nullcontext()):
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=not greedy,
                                      num_return_sequences=rows, max_new_tokens=sampling.max_tokens,
                                      min_new_tokens=min(sampling.min_tokens, sampling.max_tokens),
                                      output_scores=True, return_dict_in_generate=True,
                                      pad_token_id=self.tokenizer.pad_token_id, **(pixels or {}), **sample_args)
        new_tokens = out.sequences[:, len(prompt):]
        # scores are the processed logits the sampler drew from (after temperature / top-p)
        logprobs = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1)
        routed = routing.positions(rows) if routing else None
        # greedy: HF generates one sequence; the n samples are its copies (as vLLM's n greedy samples are)
        completions = [self._completion(new_tokens[0 if greedy else i].tolist(), logprobs[0 if greedy else i],
                                        sampling.stop) for i in range(sampling.n)]
        if routing is not None and routed is not None:
            first = RoutedExperts.start(len(prompt), self.routing_prefill)
            for i, c in enumerate(completions):
                c.routed_experts = routing.routed_experts(routed, 0 if greedy else i,
                                                          len(prompt) + len(c.token_ids) - 1, first)
        return Generation(prompt, completions)

    def _completion(self, tokens: list[int], logprobs, stop: Sequence[str] = ()) -> Completion:
        """Up to and including the first stop token (generate pads the rest of the batch row), or the token that
        completes the first stop string (its text ends before the string)."""
        end = next((i + 1 for i, t in enumerate(tokens) if t in self.stops), len(tokens))
        kept = tokens[:end]
        stopped = bool(kept) and kept[-1] in self.stops
        text = self.decode(kept)
        if stop and any(s in text for s in stop):
            for i in range(1, len(kept) + 1):
                prefix = self.decode(kept[:i])
                hits = [prefix.index(s) for s in stop if s in prefix]
                if hits:
                    kept, text, stopped = kept[:i], prefix[:min(hits)], True
                    break
        values = [float(logprobs[i, t]) for i, t in enumerate(kept)]
        return Completion(token_ids=kept, logprobs=values, text=text,
                          finish_reason="stop" if stopped else "length", weights_version=self.weights_version)

    def next_token_probs(self, prompts: Sequence[Sequence[int]], candidates: Sequence[int]) -> list[list[float]]:
        torch = self.torch
        out = []
        with torch.no_grad():
            for p in prompts:
                logits = self.model(torch.tensor([list(p)], device=self.device)).logits[0, -1].float()
                out.append(torch.softmax(logits[list(candidates)], dim=-1).tolist())
        return out

    def load_weights(self, path: str | os.PathLike, version: int) -> None:
        """A model version replaces the weights; a LoRA adapter version (rft.weights.store) is merged on load:
        each targeted weight becomes base + alpha / r * B A, from the base weights kept at the first merge."""
        if is_adapter_version(path):
            self._merge_adapter(path)
        else:
            self._load_state(iter_safetensors(path), source=str(path))
            self._base_weights = {}
        self.weights_version = version

    def _merge_adapter(self, path: str | os.PathLike) -> None:
        torch = self.torch
        config, pairs = read_adapter(path)
        scaling = float(config["lora_alpha"]) / float(config["r"])
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for module, (a, b) in pairs.items():
                weight = params.get(f"{module}.weight")
                if weight is None:
                    raise EngineError(f"adapter {path}: the model has no {module}.weight")
                base = self._base_weights.setdefault(module, weight.detach().clone())
                delta = (b.float() @ a.float()) * scaling
                weight.copy_((base.float() + delta.to(base.device)).to(weight.dtype))

    def join_push_group(self, spec: dict) -> None:
        from rft.weights.push import PushGroupSpec, PushReceiver  # heavy: torch
        from rft.weights.vllm_transfer import BACKEND  # heavy: torch

        if spec.get("backend") == BACKEND:
            raise EngineError("the push group uses vLLM's weight transfer (sync.push_transport); the transformers "
                              "engine cannot take part: set sync.push_transport: rft")
        self._push = PushReceiver.join(PushGroupSpec.from_json(spec))

    def receive_pushed_weights(self) -> int:
        from rft.weights.push import receive_into  # heavy: torch

        if self._push is None:
            raise EngineError("receive_pushed_weights before join_push_group")
        self.weights_version = receive_into(self._push, self._load_pushed)
        return self.weights_version

    def _load_pushed(self, tensors) -> None:
        """A pushed model replaces the weights; a pushed LoRA adapter (rft.weights.store) is merged on load."""
        import itertools
        import tempfile

        tensors = iter(tensors)
        first = next(tensors, None)
        if first is not None and first[0] == PUSHED_ADAPTER_CONFIG:
            with tempfile.TemporaryDirectory(prefix="rft-pushed-adapter-") as adapter_dir:
                save_pushed_adapter(first, tensors, adapter_dir)
                self._merge_adapter(adapter_dir)
            return
        self._load_state(itertools.chain([first] if first is not None else [], tensors), source="the push")
        self._base_weights = {}

    def leave_push_group(self) -> None:
        self._push = None

    def _load_state(self, tensors, *, source: str) -> None:
        state = _module_names(self.model, _fuse_experts({name: tensor.clone() for name, tensor in tensors}))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        unexpected = [k for k in unexpected if k != "lm_head.weight"]
        missing = [k for k in missing if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise EngineError(f"weights from {source} do not match the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
        if self.model.config.tie_word_embeddings:
            self.model.tie_weights()

    def close(self) -> None:
        self.model = None




def _module_names(model, state: dict) -> dict:
    """`state` with checkpoint names the model's modules do not have renamed as `from_pretrained` renames them
    (transformers' conversion mapping: Qwen2.5-VL's checkpoints say `visual.*` and `model.layers.*`, its modules
    `model.visual.*` and `model.language_model.*`); names the model has are kept."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    own = set(model.state_dict())
    if all(name in own for name in state):
        return state
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    return {name if name in own else rename_source_key(name, renamings, [])[0]: tensor
            for name, tensor in state.items()}


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _fuse_experts(state: dict) -> dict:
    """Hugging Face checkpoints store an MoE layer's experts one by one (`...experts.<e>.gate_proj.weight`, up, down:
    what the trainer exports), transformers 5 holds them fused: `...experts.gate_up_proj` [E, 2 x I, H] (each expert's
    gate rows, then its up rows) and `...experts.down_proj` [E, H, I]. Returns `state` with per-expert tensors fused
    (what `from_pretrained` converts on load); other names unchanged."""
    import torch

    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    fused = {}
    for name, tensor in state.items():
        match = _EXPERT.match(name)
        if match:
            experts.setdefault(match[1], {}).setdefault(int(match[2]), {})[match[3]] = tensor
        else:
            fused[name] = tensor
    for prefix, by_expert in experts.items():
        order = [by_expert[e] for e in range(len(by_expert))]
        fused[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([e["gate"], e["up"]]) for e in order])
        fused[f"{prefix}.down_proj"] = torch.stack([e["down"] for e in order])
    return fused
