"""single_turn: prompt -> n completions, each scored by the reward. One engine call per batch (`explore`), or one
engine request per task (`prepare` / `finish`, the continuous explorer's streaming interface). With
`explorer.greedy_baseline`, `explore` makes a second engine call: one greedy (temperature 0) completion per task,
scored by the same reward (alone: a reward that compares a group's replies sees it in a group of one); its reward is
the group's `greedy_reward`, and it is not a sample."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rft.engine import SamplingSettings
from rft.schema import TaskRecord
from rft.text.chat import ChatPrompt
from rft.workflows.registry import GroupResult, build_sample, encode_prompt, register_workflow, score_group

if TYPE_CHECKING:
    from rft.engine import Engine, Generation
    from rft.explorer.config import ExplorerConfig
    from rft.models.config import ModelConfig
    from rft.rewards import Reward


@register_workflow("single_turn")
class SingleTurn:
    records_greedy_reward = True  # explore() records each task's greedy_reward with explorer.greedy_baseline

    def __init__(self, explorer: ExplorerConfig, model: ModelConfig, reward: Reward):
        self.sampling = SamplingSettings.from_config(explorer, model)
        # one greedy completion per task, as long as the samples may be (None: no greedy baseline)
        self.greedy = (dataclasses.replace(self.sampling, n=1, temperature=0.0, top_p=1.0)
                       if explorer.greedy_baseline else None)
        self.max_prompt_len = model.max_prompt_len
        self.chat = ChatPrompt.of(model)
        self.reward = reward

    def explore(self, tasks: Sequence[TaskRecord], engine: Engine) -> list[GroupResult]:
        encoded = [self.prepare(task, engine) for task in tasks]
        runnable = {i: e for i, e in enumerate(encoded) if not isinstance(e, str)}
        generations = engine.generate(list(runnable.values()), self.sampling) if runnable else []
        results = [GroupResult(task, error=e if isinstance(e, str) else None)
                   for task, e in zip(tasks, encoded, strict=True)]
        for i, generation in zip(runnable, generations, strict=True):
            results[i] = self.finish(tasks[i], generation)
        if self.greedy is not None:
            scored = [i for i in runnable if results[i].error is None]
            greedy = engine.generate([runnable[i] for i in scored], self.greedy) if scored else []
            for i, generation in zip(scored, greedy, strict=True):
                results[i] = self._with_greedy_reward(results[i], generation)
        return results

    def _with_greedy_reward(self, result: GroupResult, greedy: Generation) -> GroupResult:
        """`result` with the reward of its task's greedy completion, or the task's error when it cannot be scored."""
        rewards = score_group(self.reward, [c.text for c in greedy.completions[:1]], result.task)
        if isinstance(rewards, str):
            return GroupResult(result.task, error=f"greedy baseline: {rewards}")
        return dataclasses.replace(result, greedy_reward=rewards[0].score)

    # -- the streaming interface of rft/explorer/continuous.py: prepare, one engine request of `sampling`, finish
    def prepare(self, task: TaskRecord, engine: Engine) -> list[int] | str:
        """The task's prompt token ids, or the reason it cannot be explored."""
        return encode_prompt(engine, task, self.max_prompt_len, self.chat)

    def finish(self, task: TaskRecord, generation: Generation) -> GroupResult:
        """The task's group from its n completions: scored, `policy_version` the oldest completion's version (the
        oldest token's: a completion's version is its oldest token's), each sample with its tokens' versions."""
        completions = generation.completions
        rewards = score_group(self.reward, [c.text for c in completions], task)
        if isinstance(rewards, str):
            return GroupResult(task, error=rewards)
        samples = [build_sample(k, prompt=generation.prompt_token_ids, tokens=c.token_ids, logprobs=c.logprobs,
                                loss_mask=[1] * len(c.token_ids), reward=r, finish_reason=c.finish_reason,
                                routed_experts=c.routed_experts, token_versions=c.token_versions)
                   for k, (c, r) in enumerate(zip(completions, rewards, strict=True))]
        return GroupResult(task, samples=samples, policy_version=min(c.weights_version for c in completions))
