"""Workflows: how a task becomes a group of samples (rollout + reward).

The interface is one method (AReaL's): `explore(tasks, engine) -> list[GroupResult]`, one result per
task, in task order. It takes a batch of tasks rather than one so that the engine batches all of their
rollouts into one call; each result is still one task's group.

Contract of a `GroupResult`:
- `samples` are the group's `n` samples, each with prompt tokens, response tokens, behaviour log-probs
  and a loss mask of the response's length (1 for tokens the model generated, 0 for tokens an
  environment inserted, whose log-probs are 0), and a reward in [0, 1].
- `policy_version` is the oldest weights version that generated any token of the group.
- A task that cannot be explored (prompt too long, ...) has `error` set and no samples; the explorer
  sends it to the dead-letter topic and goes on.

Workflows are registered by name (`@register_workflow`) and built with `(cfg, reward)`; an import path
`package.module:Class` is the escape hatch. `check_workflow_config` resolves names at config load time.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

from rft.imports import registrar
from rft.schema import Sample, TaskRecord

if TYPE_CHECKING:
    from rft.config import Config, ExplorerConfig
    from rft.explorer.engine import Engine
    from rft.rewards import Reward, RewardResult


class WorkflowError(ValueError):
    """An unknown workflow or environment, or one that cannot be built."""


@dataclass
class GroupResult:
    task: TaskRecord
    samples: list[Sample] = field(default_factory=list)
    policy_version: int = 0
    error: str | None = None


class Workflow(Protocol):
    def explore(self, tasks: Sequence[TaskRecord], engine: "Engine") -> list[GroupResult]: ...


_WORKFLOWS: dict[str, Any] = {}


register_workflow = registrar(_WORKFLOWS, "workflow", error=WorkflowError)  # class decorator; cls(cfg, reward) builds it


def available_workflows() -> list[str]:
    _load_builtins()
    return sorted(_WORKFLOWS)


def resolve_workflow(spec: str) -> Any:
    _load_builtins()
    if spec in _WORKFLOWS:
        return _WORKFLOWS[spec]
    if ":" in spec:
        return import_by_path(spec, "workflow")
    near = difflib.get_close_matches(spec, list(_WORKFLOWS), n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    raise WorkflowError(f"unknown workflow {spec!r}{hint}; registered: {', '.join(sorted(_WORKFLOWS))}; "
                        "or give an import path package.module:Class")


def import_by_path(spec: str, what: str) -> Any:
    from rft.rewards import RewardError, import_object
    try:
        return import_object(spec, what=what)
    except RewardError as e:
        raise WorkflowError(str(e)) from None


def check_workflow_config(explorer: "ExplorerConfig") -> None:
    """Resolve `explorer.workflow` (and, for multi_turn, `explorer.environment`); errors start with the key."""
    try:
        resolve_workflow(explorer.workflow)
    except WorkflowError as e:
        raise WorkflowError(f"explorer.workflow: {e}") from None
    if explorer.workflow == "multi_turn":
        from rft.workflows.multi_turn import resolve_environment
        try:
            resolve_environment(explorer.environment)
        except WorkflowError as e:
            raise WorkflowError(f"explorer.environment: {e}") from None


def build_workflow(cfg: "Config", reward: "Reward") -> Workflow:
    return resolve_workflow(cfg.explorer.workflow)(cfg, reward)


# --------------------------------------------------------------------------------------------------
# Pieces shared by the built-in workflows.


def encode_prompt(engine: "Engine", task: TaskRecord, max_prompt_len: int) -> list[int] | str:
    """The task's prompt as token ids, or the reason it cannot be explored."""
    ids = engine.encode(task.prompt)
    if not ids:
        return "prompt is empty after tokenization"
    if len(ids) > max_prompt_len:
        return f"prompt is {len(ids)} tokens, over model.max_prompt_len={max_prompt_len}"
    return ids


def build_sample(index: int, *, prompt: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float],
                 loss_mask: Sequence[int], reward: "RewardResult", finish_reason: str,
                 metadata: dict[str, Any] | None = None, extra_components: dict[str, float] | None = None) -> Sample:
    """One sample with the wire dtypes (int32 tokens, float32 log-probs, uint8 mask)."""
    return Sample(sample_index=index, prompt_tokens=np.asarray(prompt, dtype=np.int32),
                  response_tokens=np.asarray(tokens, dtype=np.int32), logprobs=np.asarray(logprobs, dtype=np.float32),
                  loss_mask=np.asarray(loss_mask, dtype=np.uint8), reward=reward.score,
                  reward_components={**reward.components, **(extra_components or {})},
                  finish_reason=finish_reason, metadata=metadata or {})


_BUILTINS_LOADED = False


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        from rft.workflows import multi_turn, single_turn  # noqa: F401
