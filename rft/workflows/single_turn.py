"""single_turn: prompt -> n completions, each scored by the reward. One engine call per batch."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from rft.chat import ChatPrompt
from rft.explorer.engine import SamplingSettings
from rft.schema import TaskRecord
from rft.workflows.registry import GroupResult, build_sample, encode_prompt, register_workflow, score_group

if TYPE_CHECKING:
    from rft.config import ExplorerConfig, ModelConfig
    from rft.explorer.engine import Engine
    from rft.rewards import Reward


@register_workflow("single_turn")
class SingleTurn:
    def __init__(self, explorer: "ExplorerConfig", model: "ModelConfig", reward: "Reward"):
        self.sampling = SamplingSettings.from_config(explorer, model)
        self.max_prompt_len = model.max_prompt_len
        self.chat = ChatPrompt.of(model)
        self.reward = reward

    def explore(self, tasks: Sequence[TaskRecord], engine: "Engine") -> list[GroupResult]:
        encoded = [encode_prompt(engine, task, self.max_prompt_len, self.chat) for task in tasks]
        runnable = [i for i, e in enumerate(encoded) if not isinstance(e, str)]
        generations = engine.generate([encoded[i] for i in runnable], self.sampling) if runnable else []
        results = [GroupResult(task, error=e if isinstance(e, str) else None) for task, e in zip(tasks, encoded)]
        for i, generation in zip(runnable, generations):
            completions = generation.completions
            rewards = score_group(self.reward, [c.text for c in completions], tasks[i])
            if isinstance(rewards, str):
                results[i].error = rewards
                continue
            results[i].samples = [
                build_sample(k, prompt=generation.prompt_token_ids, tokens=c.token_ids, logprobs=c.logprobs,
                             loss_mask=[1] * len(c.token_ids), reward=r, finish_reason=c.finish_reason)
                for k, (c, r) in enumerate(zip(completions, rewards))]
            results[i].policy_version = min(c.weights_version for c in completions)
        return results
