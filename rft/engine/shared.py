"""One vLLM engine shared by several runs of the same base model, each through an `AdapterSlot` of its own (an
`Engine`): the explorer that serves several LoRA runs at once (`rft explorer A.yaml B.yaml`, rft/explorer/multirun.py).

Contracts:
- A slot's weights are its run's newest LoRA adapter, loaded into the shared engine under the slot's name
  (`VLLMEngine.load_adapter`): `load_weights` of one slot loads that run's adapter and nothing else; the other slots'
  adapters stay loaded, untouched (the engine keeps one adapter more than it serves, vLLM's `max_cpu_loras`, so
  replacing one never evicts another, which vLLM would read again from a store that may have deleted it).
- A whole-model version is refused (EngineError): it would replace the base every other run generates with.
- `weights_version` is the slot's own: the version of its adapter, or the base's (the engine's version at start)
  before its first adapter; every completion a slot returns carries it.
- The engine is used by one slot at a time (one lock, held by `generate`, `next_token_probs` and `load_weights`;
  vLLM's `LLM` is not thread-safe, and each run's explorer loop is a thread). Each slot tokenizes with its own copy
  of the engine's tokenizer (Hugging Face fast tokenizers must not be used by two threads at once), outside the lock.
- Pushed weights are refused: a push group drives the whole engine (the explorer refuses `sync.method: push` for a
  shared engine before it starts).
- `close()` closes nothing: the shared engine belongs to whoever built it.
"""
from __future__ import annotations

import copy
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rft.engine.base import EngineError, Generation, SamplingSettings, TokenizerMixin
from rft.weights.store import is_adapter_version

if TYPE_CHECKING:
    from rft.engine.vllm_engine import VLLMEngine


class AdapterSlot(TokenizerMixin):
    """Run `name`'s view of the shared `engine` (module docstring); `lock` is the one every slot of the engine holds
    (`adapter_slots` makes them)."""

    def __init__(self, engine: VLLMEngine, name: str, lock: threading.Lock):
        self.engine, self.name, self._lock = engine, name, lock
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.stop_token_ids = list(engine.stop_token_ids)
        self.max_model_len = engine.max_model_len
        self.weights_version = engine.weights_version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[Generation]:
        with self._lock:
            if self.name in self.engine.adapters:
                return self.engine.generate(prompts, sampling, adapter=self.name)
            generations = self.engine.generate(prompts, sampling)  # the base: no adapter of this run yet
        for completion in (c for g in generations for c in g.completions):
            completion.stamp(self.weights_version)
        return generations

    def next_token_probs(self, prompts: Sequence[Sequence[int]], candidates: Sequence[int]) -> list[list[float]]:
        raise EngineError(f"run {self.name}: next-token probabilities of a shared engine's adapter are not "
                          "implemented (a judge reward builds an engine of its own)")

    def load_weights(self, path: str | os.PathLike, version: int) -> None:
        require_adapter(self.name, path, version)
        with self._lock:
            self.engine.load_adapter(self.name, path, version)
            self.weights_version = version

    def join_push_group(self, spec: dict) -> None:
        raise self._no_push()

    def receive_pushed_weights(self) -> int:
        raise self._no_push()

    def _no_push(self) -> EngineError:
        return EngineError(f"run {self.name}: an engine shared by several runs takes no pushed weights "
                           "(sync.method: pull)")

    def leave_push_group(self) -> None:
        pass

    def close(self) -> None:
        pass


def require_adapter(run: str, path: str | os.PathLike, version: int) -> None:
    """EngineError unless `path` (run `run`'s `version`) is a LoRA adapter version (module docstring)."""
    if not is_adapter_version(path):
        raise EngineError(f"run {run}: version {version} ({path}) is a whole model, not a LoRA adapter; an engine "
                          "shared by several runs keeps its base and takes each run's versions as adapters (train the "
                          "run with model.lora)")


def adapter_slots(engine: VLLMEngine, names: Sequence[str]) -> list[AdapterSlot]:
    """One slot per name (the runs' names, distinct) over `engine`, which must hold LoRA adapters, at least one per
    slot (`max_loras`)."""
    if len(set(names)) != len(names):
        raise EngineError(f"adapter slots need distinct names, got {list(names)}")
    lora = engine.llm.llm_engine.vllm_config.lora_config
    if not lora or lora.max_loras < len(names):
        raise EngineError(f"{len(names)} runs' adapters need a vLLM engine started with LoRA and max_loras >= "
                          f"{len(names)} (it has {lora.max_loras if lora else 'no LoRA'})")
    lock = threading.Lock()
    return [AdapterSlot(engine, name, lock) for name in names]
