"""The engine interface: sampling settings, completions, the `Engine` protocol and the tokenizer half both
implementations share. Contracts: the package docstring (rft/engine/__init__.py)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

from rft.text.chat import ChatPrompt, encode_chat, observation_text, stop_token_ids

if TYPE_CHECKING:
    from rft.config import ExplorerConfig, ModelConfig
    from rft.schema import RoutedExperts

log = logging.getLogger(__name__)

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
    weights_version: int  # the oldest version that generated any of its tokens
    # an engine recording MoE routing: the experts of each input position (prompt + tokens but the last one)
    routed_experts: "RoutedExperts | None" = None
    # the version that generated each token (one per token_ids entry); None: every token is `weights_version`
    token_versions: "list[int] | None" = None


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


class TokenizerMixin:
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


