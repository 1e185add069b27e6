"""Workflows: how a task becomes a group of samples (rollout + reward); the contract is in
`rft.workflows.registry`.

Workflows are registered by name (`@register_workflow`) and built with `(explorer, model, reward)`; an import
path `package.module:Class` is the escape hatch. Names are resolved when a config is loaded for a run
(`rft.run.loading` calls `check_workflow_config`). Importing this package registers the built-in workflows
(single_turn, multi_turn, tool_agent, openenv, agent_program, verifiers) and multi_turn's environments (retry,
frozenlake, textarena).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rft.extras import check_installed
from rft.workflows import (  # noqa: F401  (registers the built-ins)
    agent_program,
    frozenlake,
    multi_turn,
    openenv_adapter,
    single_turn,
    textarena_game,
    tool_agent,
    verifiers,
)
from rft.workflows.multi_turn import ENVIRONMENTS, register_environment
from rft.workflows.registry import (
    WORKFLOWS,
    GroupResult,
    Workflow,
    WorkflowError,
    build_sample,
    encode_prompt,
    refuses_images,
    register_workflow,
    takes_images,
)

if TYPE_CHECKING:
    from rft.explorer.config import ExplorerConfig
    from rft.models.config import ModelConfig
    from rft.rewards import Reward

__all__ = ["ENVIRONMENTS", "WORKFLOWS", "GroupResult", "Workflow", "WorkflowError", "available_workflows",
           "build_sample", "build_workflow", "check_workflow_config", "encode_prompt", "greedy_baseline_problem",
           "image_sets_problem", "register_environment", "register_workflow", "resolve_workflow", "streams",
           "takes_images"]


def available_workflows() -> list[str]:
    return sorted(WORKFLOWS)


def resolve_workflow(spec: str) -> Any:
    """The class registered as `spec`, or at the import path `spec`; WorkflowError naming explorer.workflow."""
    return WORKFLOWS.resolve(spec, key="explorer.workflow")


def check_workflow_config(explorer: ExplorerConfig) -> None:
    """Resolve `explorer.workflow` (and, for multi_turn, `explorer.environment`, whose optional extra must be installed
    (MissingExtra); for tool_agent, `explorer.tools`; for agent_program, its command and directory; for verifiers,
    that it names an environment); errors start with the key."""
    cls = resolve_workflow(explorer.workflow)
    if explorer.continuous and not streams(cls):
        raise WorkflowError(f"explorer.continuous: workflow {explorer.workflow} has no streaming interface (prepare, "
                            f"finish: rft/explorer/continuous.py); continuous submission supports single-turn "
                            f"workflows ({', '.join(w for w in available_workflows() if streams(WORKFLOWS[w]))})")
    if explorer.workflow == "multi_turn":
        environment = ENVIRONMENTS.resolve(explorer.environment, key="explorer.environment")
        extra = multi_turn.needs_extra(environment)
        if extra:
            check_installed(extra, feature=f"explorer.environment: {explorer.environment}")
    if explorer.workflow == "tool_agent":
        tool_agent.build_toolbox(explorer)
    if explorer.workflow == "openenv":
        openenv_adapter.check_options(explorer.openenv)
    if explorer.workflow in ("agent_program", "verifiers"):  # their model calls go to the recording endpoint
        check_installed("web", feature=f"explorer.workflow: {explorer.workflow} (its recording endpoint)")
    if explorer.workflow == "agent_program":
        agent_program.check_config(explorer)
    if explorer.workflow == "verifiers" and (problem := verifiers.config_problem(explorer.verifiers,
                                                                                     installed=False)):
        raise WorkflowError(problem)
    if explorer.greedy_baseline and (problem := greedy_baseline_problem(explorer)):
        raise WorkflowError(problem)


def greedy_baseline_problem(explorer: ExplorerConfig) -> str | None:
    """None when the explorer can record each task's greedy reward (`explorer.greedy_baseline`: a workflow with
    `records_greedy_reward`, the batch loop), else why not, starting with the key to change."""
    if not getattr(resolve_workflow(explorer.workflow), "records_greedy_reward", False):
        able = [w for w in available_workflows() if getattr(WORKFLOWS[w], "records_greedy_reward", False)]
        return (f"explorer.workflow: workflow {explorer.workflow} does not record each task's greedy reward "
                f"(explorer.greedy_baseline); workflows that do: {', '.join(able)}")
    if explorer.continuous:
        return ("explorer.continuous: the continuous loop generates no greedy response per task "
                "(explorer.greedy_baseline); set it to false (the batch loop does)")
    return None


def image_sets_problem(explorer: ExplorerConfig, image_keys: Sequence[str]) -> str | None:
    """None when no task set gives image tasks (`image_keys`: the config keys of those that do, e.g.
    `eval.sets[0].format`) or `explorer.workflow` takes images (`takes_images`); else why not, starting with the key."""
    if not image_keys or takes_images(resolve_workflow(explorer.workflow)):
        return None
    return (f"explorer.workflow: {refuses_images(f'workflow {explorer.workflow}')}, and {image_keys[0]} gives tasks "
            "with images")


def streams(workflow: Any) -> bool:
    """Whether a workflow (class or instance) has the streaming interface the continuous explorer drives: one engine
    request per task, `prepare(task, engine) -> prompt ids | ImagePrompt | reason` and `finish(task, generation) ->
    GroupResult`,
    with its `sampling` (rft/explorer/continuous.py)."""
    return callable(getattr(workflow, "prepare", None)) and callable(getattr(workflow, "finish", None))


def build_workflow(explorer: ExplorerConfig, model: ModelConfig, reward: Reward) -> Workflow:
    return resolve_workflow(explorer.workflow)(explorer, model, reward)
