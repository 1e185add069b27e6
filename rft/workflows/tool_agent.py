"""tool_agent: the model calls tools through its chat template's tool-calling format; tool results come back as
masked tokens; the episode is scored on the final answer.

Episode (multi_turn's machinery, `rft.workflows.multi_turn.MultiTurn`, with tool calls as the environment):
1. the prompt is the task's prompt rendered by the chat template with the tool schemas of `explorer.tools`
   (`apply_chat_template(messages, tools=[...])`; a template that ignores tools gets the Hermes instructions in
   its system message, see rft/text/chat.py). `model.chat_template: true` is required.
2. the model's turn ends at the template's end-of-turn token. If it holds `<tool_call>` blocks (the formats
   `rft.agent_tools.registry` recognises), each call runs (in order) and its result, or an `error: ...` message for a
   bad call, becomes a `{"role": "tool", "name", "content"}` message. The tokens the template writes for those
   messages after the model's end-of-turn token, through the next assistant header (`rft.text.chat.tool_turn_text`),
   are appended with loss_mask 0 and log-prob 0, and the model continues.
3. a turn without a tool call is the final answer. So is a turn cut by the token limit (finish reason
   `length`: it has no end-of-turn token to continue after) and the turn `explorer.max_turns`; the response
   budget `model.max_response_len` counts model and tool tokens together, and a tool turn that would leave no
   room for a model token ends the episode instead.
The reward is the run's configured reward of the last model turn's text (components add `turns`). A call the
python tool's sandbox refuses to run (`SandboxError`: bwrap could not set up) fails the episode as `sandbox`.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from rft.agent_tools import SandboxError, ToolBox, ToolError, ToolLimits
from rft.schema import TaskRecord
from rft.text.chat import ChatPrompt, tool_turn_text
from rft.workflows.multi_turn import MultiTurn, _Episode
from rft.workflows.registry import WorkflowError, register_workflow

if TYPE_CHECKING:
    from rft.engine import Engine
    from rft.explorer.config import ExplorerConfig
    from rft.models.config import ModelConfig
    from rft.rewards import Reward


def build_toolbox(explorer: ExplorerConfig) -> ToolBox:
    """The tools `explorer.tools` names, under the explorer's limits; WorkflowError naming the key."""
    limits = ToolLimits(timeout_s=explorer.tool_timeout_s, memory_mb=explorer.tool_memory_mb,
                        output_chars=explorer.tool_output_chars, sandbox=explorer.python_sandbox,
                        max_processes=explorer.tool_max_processes, workdir_mb=explorer.python_workdir_mb)
    try:
        return ToolBox(explorer.tools, limits)
    except ToolError as e:
        raise WorkflowError(str(e)) from None


log = logging.getLogger(__name__)


class _Conversation:
    """An episode's `environment`: the task whose conversation the tool messages continue."""

    def __init__(self, task: TaskRecord, reward: Reward):
        self.task = task


@register_workflow("tool_agent")
class ToolAgent(MultiTurn):
    def __init__(self, explorer: ExplorerConfig, model: ModelConfig, reward: Reward):
        super().__init__(explorer, model, reward)
        if not model.chat_template:
            raise WorkflowError("model.chat_template: the tool_agent workflow shows tools and their results through "
                                "the chat template; set model.chat_template: true")
        self.toolbox = build_toolbox(explorer)
        self.tool_chat = ChatPrompt(model.system_prompt, tuple(self.toolbox.schemas))  # = ChatPrompt.of: a template
        self.chat = self.tool_chat
        self.environment_cls = _Conversation

    def _environment_turn(self, episode: _Episode, engine: Engine, *, last_turn: bool) -> None:
        if last_turn or episode.finish_reason != "stop" or len(episode.tokens) >= self.max_response_len:
            episode.done = True
            return
        try:
            calls = self.toolbox.run_calls(episode.last_text)
        except SandboxError as e:  # the sandbox refused to run a call: the episode failed, not the model
            log.warning("tool_agent: %s", e)
            episode.done, episode.failure = True, "sandbox"
            return
        if not calls:  # the final answer
            episode.done = True
            return
        results: list[dict[str, Any]] = [{"role": "tool", "name": call.name or "unknown", "content": result}
                                         for call, result in calls]
        conversation = episode.environment
        assert isinstance(conversation, _Conversation)  # this workflow's environment_cls
        text = tool_turn_text(engine.tokenizer, self.tool_chat.messages(conversation.task.prompt), results,
                              self.tool_chat.tools)
        observation = engine.encode(text, add_special_tokens=False)
        if len(episode.tokens) + len(observation) >= self.max_response_len:  # no room left for a model token
            episode.done = True
            return
        episode.add_environment_turn(observation)
