"""A group of samples from one prefill of its prompt (`explorer.prefill_once`; `VLLMEngine` runs it).

vLLM's prefix cache reuses whole KV blocks and never a prompt's last token (its logits are needed), so the n samples
of a prompt whose length is a multiple of the block size would each compute the prompt's last block (how often that
is, and what this saves: docs/benchmarks.md, "A group's prompt computed once"). Instead a `ForkedGroup` runs:

1. one **probe** request (the prompt, one token, vLLM's top-`PROBE_TOKENS` processed log-probs: temperature and top-p
   applied) computes the prompt once;
2. each sample's first token is drawn here, exactly from that distribution: with the probability mass of the tokens
   the probe returned, one of them (its log-prob as returned); otherwise (the rest of the mass, the tail) a **tail**
   request draws it from the other tokens only (vLLM's logit bias -100 on the probe's tokens: their mass falls by
   e^-100; the prompt computed again), and its log-prob is vLLM's within the tail plus the log of the tail's mass;
3. each sample goes on as a **rest** request, the prompt + its first token, which finds the prompt's blocks in the
   cache and computes one token before decoding; a first token that ends a completion makes a one-token sample.

Exactness needs the tail's conditional distribution, which the logit bias gives with top-p 1 only: with top-p
below 1 and a nucleus wider than the probe's tokens the group runs as one ordinary request instead (**all**). A tail
request that ran on another version than the probe (an in-flight load between them) is dropped and its sample runs
as an ordinary request of its own (**whole**). Each token carries the version that computed its distribution.

Requests are named `<group id>/<kind><sample>`; `requests()` hands out what to send next, `on_*` take what came back.
This module imports no vLLM: the engine turns `Request`s into vLLM requests.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from rft.engine.base import Completion, Generation, SamplingSettings

# log-probs the probe asks for: vLLM computes this many for every sequence of an engine step that holds a probe, so
# more costs every step and fewer costs tail requests (the mass outside them: docs/benchmarks.md)
PROBE_TOKENS = 1000
TOP_P_TAIL = 1e-4  # top-p < 1: a tail mass above this means the nucleus is wider than the probe's tokens
NO_TAIL = 1e-6  # a tail mass below this is float32 rounding of the probe's log-probs (a whole vocabulary returned)


def prefills_once(prompt_len: int, sampling: SamplingSettings, block_size: int) -> bool:
    """Whether a group gains from one prefill: n > 1 samples of at least two tokens, sampled (temperature > 0)
    without stop strings (a first token's text could hold one), and a prompt of whole KV blocks."""
    return (sampling.n > 1 and sampling.max_tokens > 1 and sampling.temperature > 0 and not sampling.stop
            and prompt_len % block_size == 0)


@dataclass(frozen=True)
class Request:
    """One vLLM request of a group: `kind` probe, tail, rest, whole or all (module docstring), for sample `index`
    (-1 for the probe, 0 for all), `max_tokens` new tokens, `n` samples, tokens it may not draw (`exclude`, tail)."""
    request_id: str
    kind: str
    index: int
    prompt: list[int]
    max_tokens: int
    n: int = 1
    exclude: frozenset[int] = frozenset()


@dataclass
class ForkedGroup:
    request_id: str
    prompt: list[int]
    sampling: SamplingSettings
    end_ids: frozenset[int]  # tokens that end a completion
    version: int = -1  # the probe's
    known: dict[int, float] = field(default_factory=dict)  # the probe's tokens -> processed log-prob
    tail_mass: float = 0.0
    firsts: dict[int, tuple[int, float, int]] = field(default_factory=dict)  # sample -> (token, log-prob, version)
    samples: dict[int, Completion] = field(default_factory=dict)  # sample -> its whole completion
    whole_group: Generation | None = None  # ran as one ordinary request (all)
    _outbox: list[Request] = field(default_factory=list)

    def __post_init__(self):
        self._outbox.append(Request(f"{self.request_id}/probe", "probe", -1, list(self.prompt), 1))

    def requests(self) -> list[Request]:
        """The requests to send now (each once)."""
        out, self._outbox = self._outbox, []
        return out

    def on_probe(self, known: dict[int, float], version: int, rng: np.random.Generator) -> None:
        """The probe's tokens and their processed log-probs (-inf: outside the top-p nucleus), and its version."""
        self.version = version
        self.known = {t: lp for t, lp in known.items() if math.isfinite(lp)}
        tokens = list(self.known)
        probs = np.exp(np.array([self.known[t] for t in tokens], dtype=np.float64))
        self.tail_mass = max(0.0, 1.0 - float(probs.sum()))
        if self.tail_mass < NO_TAIL:
            self.tail_mass = 0.0
        if self.sampling.top_p < 1.0:
            if self.tail_mass > TOP_P_TAIL:  # the nucleus reaches past the probe's tokens: no exact tail
                self._send("all", 0, self.prompt, self.sampling.max_tokens, n=self.sampling.n)
                return
            self.tail_mass = 0.0
        weights = np.append(probs, self.tail_mass)
        for i, pick in enumerate(rng.choice(len(weights), size=self.sampling.n, p=weights / weights.sum())):
            if pick == len(tokens):
                self._send("tail", i, self.prompt, 1, exclude=frozenset(self.known))
            else:
                self._first(i, tokens[pick], self.known[tokens[pick]], version)

    def on_tail(self, index: int, token: int, tail_logprob: float, version: int) -> None:
        """A tail request's token, its log-prob within the tail, and the version that drew it."""
        if version != self.version:  # not the probe's distribution: the sample runs as an ordinary request
            self._send("whole", index, self.prompt, self.sampling.max_tokens)
            return
        self._first(index, token, tail_logprob + math.log(self.tail_mass), version)

    def on_sample(self, index: int, completion: Completion, kind: str) -> None:
        """A rest request's completion (after the sample's first token) or a whole request's (the whole sample)."""
        if kind == "whole":
            self.samples[index] = completion
            return
        token, logprob, version = self.firsts[index]
        versions = None if completion.token_versions is None else [version] + completion.token_versions
        self.samples[index] = Completion([token] + completion.token_ids, [logprob] + completion.logprobs, "",
                                         completion.finish_reason, min(version, completion.weights_version),
                                         token_versions=versions)

    def on_all(self, generation: Generation) -> None:
        self.whole_group = generation

    def complete(self) -> bool:
        return self.whole_group is not None or len(self.samples) == self.sampling.n

    def generation(self, decode: Callable[[Sequence[int]], str]) -> Generation:
        """The group's samples in sample order; `decode` makes each sample's text from its tokens."""
        if self.whole_group is not None:
            return self.whole_group
        samples = [self.samples[i] for i in range(self.sampling.n)]
        for sample in samples:
            sample.text = decode(sample.token_ids)
        return Generation(list(self.prompt), samples)

    def _first(self, index: int, token: int, logprob: float, version: int) -> None:
        self.firsts[index] = (token, logprob, version)
        if token in self.end_ids:
            self.samples[index] = Completion([token], [logprob], "", "stop", version, token_versions=[version])
        else:
            self._send("rest", index, self.prompt + [token], self.sampling.max_tokens - 1)

    def _send(self, kind: str, index: int, prompt: list[int], max_tokens: int, *, n: int = 1,
              exclude: frozenset[int] = frozenset()) -> None:
        self._outbox.append(Request(f"{self.request_id}/{kind}{index}", kind, index, list(prompt), max_tokens, n,
                                    exclude))
