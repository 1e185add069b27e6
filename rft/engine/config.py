"""The engine's and sampling's keys of the `explorer` section (and of `rft serve`'s and the evaluator's engines):
which engine generates, with what resources, and how samples are drawn."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rft.config import COUNT, OPTIONAL, POSITIVE, Range, Section, SectionError, at_least, option


@dataclass(frozen=True)
class EngineOptions(Section):
    """How each explorer's engine runs (vLLM or transformers) and the resources it takes."""
    KEY = "explorer"
    engine: Literal["vllm", "transformers"] = option("vllm",
        help="transformers: HF generate in-process (reference, slow)")
    tensor_parallel_size: int = option(1, range=COUNT,
        help="GPUs (vLLM tensor-parallel workers) of each explorer's engine, and of `rft serve`'s and the "
        "evaluator's")
    gpu_memory_utilization: float = option(0.5, range=Range(0, 1, low_open=True),
        help="vLLM on a GPU: the share of its memory the engine may take (weights, KV cache); lower it when parts "
        "share GPUs")
    cpu_kvcache_gb: float = option(1.0, range=POSITIVE,
        help="vLLM on CPU: GiB of memory the engine reserves for its KV cache")
    cpu_kv_block_size: int = option(32, range=at_least(32, "a multiple of 32"),
        help="vLLM on CPU: tokens per KV-cache block, a multiple of 32 (vLLM's CPU default 128). Prefix caching "
        "shares whole blocks, so a group's samples share their prompt's KV only for its full blocks "
        "(rft/engine/vllm_engine.py)")
    prefill_once: bool = option(True,
        help="vLLM: a group whose prompt fills whole KV blocks (length a multiple of the block size) computes its "
        "prompt once; its n first tokens are drawn from that one distribution (rft/engine/prefill_once.py)")
    vllm_in_process: bool | None = option(None,
        help="null: in-process on CPU with TP 1 (fast start), own process otherwise")

    def validate(self) -> None:
        if self.cpu_kv_block_size % 32:
            raise SectionError("cpu_kv_block_size", f"must be a multiple of 32 (vLLM's CPU attention), got "
                              f"{self.cpu_kv_block_size}")


@dataclass(frozen=True)
class SamplingOptions(Section):
    """How the explorers sample: group size, temperature, nucleus and length."""
    KEY = "explorer"
    n_samples: int = option(8, range=COUNT,
        help="samples generated per task: the size of each experience group (the baseline of group advantages)")
    temperature: float = option(1.0, range=at_least(0, "0: greedy"),
        help="sampling temperature of the explorers (0: greedy); the trainer computes log-probs at it (0 counts as"
        " 1)")
    top_p: float = option(1.0, range=Range(0, 1, low_open=True),
        help="nucleus sampling of the explorers, in (0, 1]: sample from the most likely tokens holding this "
        "probability; 1: off")
    max_tokens: int = option(32, range=COUNT,
        help="new tokens per sample (multi_turn, tool_agent: per model turn), at most model.max_response_len")
    min_tokens: int = option(0, range=OPTIONAL,
        help="single_turn samples: no stop token (EOS, stop_token_ids) ends a sample before this many new tokens; "
        "at most max_tokens (= max_tokens: every sample is that long, e.g. to size long-trace runs); 0: off")

    def validate(self) -> None:
        if self.min_tokens > self.max_tokens:
            raise SectionError("min_tokens", f"must be at most explorer.max_tokens ({self.max_tokens}), got "
                              f"{self.min_tokens}")
