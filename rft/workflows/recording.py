"""An episode's recorded engine calls (`RecordedCall`, what the recording endpoint of rft/workflows/endpoint.py keeps
of each chat completion) and how they become samples (`episode_branches`, `branch_sample`).

Stitching, on token ids only (nothing is re-tokenised):
- A call's *parent* is the latest earlier call whose prompt + completion tokens are a prefix of its prompt tokens
  (`find_parent`); a call with none is a *root* (the first call, or one after the client compacted or rewrote the
  conversation).
- Calls are taken in order. A call whose parent is the last call of a branch extends that branch; any other call
  starts a new branch: a root alone, or a fork (its parent is not a branch's last call, e.g. a retry from an earlier
  state) as the path from its root through its parent to it.
- One sample per branch: prompt = the root's prompt tokens; response = each call's completion (loss_mask 1, the
  engine's log-probs) and, between calls, the tokens the client added (tool results, user turns: loss_mask 0,
  log-prob 0). In a fork, the calls its path shares with an earlier branch are masked too (loss_mask 0, log-prob
  0): every completion token is trained once. `turns`: one per call of the branch, from its completion's first token
  to the next call's completion (its completion and the client's tokens after it), `state` the hash of the call's
  prompt tokens (equal prompts, equal states); a call with neither completion nor following tokens has no turn.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rft.schema import Sample, Turn


@dataclass
class RecordedCall:
    """One chat completion as the engine ran it: the prompt token ids rft rendered (`prompt`), the completion's token
    ids, behaviour log-probs and finish reason, the weights version, and the normalised conversation (`messages`,
    `reply`, `tools`: what the endpoint matches a later request against)."""
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    finish_reason: str
    weights_version: int
    messages: list[dict[str, Any]] = field(default_factory=list)  # the request's messages, as the template saw them
    reply: dict[str, Any] = field(default_factory=dict)  # the assistant message it answered, as read back
    tools: str = ""  # the request's tools, canonical JSON

    @property
    def end(self) -> list[int]:
        """Its prompt and completion: a call whose prompt starts with these continues it."""
        return self.prompt + self.completion


@dataclass(frozen=True)
class Branch:
    """One sample's calls: indices into the episode's calls, root first, and which of them it trains (the others are
    masked: a fork's shared path)."""
    calls: tuple[int, ...]
    trained: frozenset[int]


def state_key(prompt: Sequence[int]) -> str:
    """The key of the state a call acted from: a hash of its prompt token ids."""
    return hashlib.sha1(np.asarray(prompt, dtype="<i4").tobytes()).hexdigest()[:16]


def extends(prompt: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(prompt) >= len(prefix) and list(prompt[:len(prefix)]) == list(prefix)


def find_parent(calls: Sequence[RecordedCall], prompt: Sequence[int]) -> int | None:
    """The latest call whose prompt + completion is a prefix of `prompt` (the longest on a tie), None: a root."""
    best: int | None = None
    for i, call in enumerate(calls):
        if extends(prompt, call.end) and (best is None or len(call.end) >= len(calls[best].end)):
            best = i
    return best


def episode_branches(calls: Sequence[RecordedCall]) -> list[Branch]:
    """The episode's branches, in the order they start (module docstring)."""
    parents = [find_parent(calls[:i], c.prompt) for i, c in enumerate(calls)]
    paths: list[list[int]] = []
    trained: list[set[int]] = []
    tip: dict[int, int] = {}  # a branch's last call -> the branch
    for i, parent in enumerate(parents):
        if parent is not None and parent in tip:
            b = tip.pop(parent)
            paths[b].append(i)
            trained[b].add(i)
        else:
            path = [i]
            while parents[path[0]] is not None:
                path.insert(0, parents[path[0]])  # type: ignore[arg-type]  # checked in the loop condition
            paths.append(path)
            trained.append({i})
            b = len(paths) - 1
        tip[i] = b
    return [Branch(tuple(p), frozenset(t)) for p, t in zip(paths, trained, strict=True)]


def branch_sample(calls: Sequence[RecordedCall], branch: Branch, index: int, *, reward: float,
                  components: dict[str, float] | None = None, failure: str = "",
                  metadata: dict[str, Any] | None = None) -> Sample:
    """The sample of one branch (module docstring) with `reward` (ignored when `failure` is set)."""
    root = calls[branch.calls[0]]
    tokens: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    starts: list[int] = []
    previous: RecordedCall | None = None
    for i in branch.calls:
        call = calls[i]
        if previous is not None:
            added = call.prompt[len(previous.end):]
            tokens += added
            logprobs += [0.0] * len(added)
            mask += [0] * len(added)
        starts.append(len(tokens))
        tokens += call.completion
        trained = i in branch.trained
        logprobs += list(call.logprobs) if trained else [0.0] * len(call.completion)
        mask += [int(trained)] * len(call.completion)
        previous = call
    ends = starts[1:] + [len(tokens)]
    turns = [Turn(start, end, state_key(calls[i].prompt))
             for i, start, end in zip(branch.calls, starts, ends, strict=True) if end > start]
    return Sample(sample_index=index, prompt_tokens=np.asarray(root.prompt, dtype=np.int32),
                  response_tokens=np.asarray(tokens, dtype=np.int32), logprobs=np.asarray(logprobs, dtype=np.float32),
                  loss_mask=np.asarray(mask, dtype=np.uint8), reward=0.0 if failure else reward,
                  reward_components=dict(components or {}), finish_reason=calls[branch.calls[-1]].finish_reason,
                  metadata=dict(metadata or {}), failure=failure, turns=turns)
