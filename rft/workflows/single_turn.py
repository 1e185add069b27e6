"""single_turn: prompt -> n completions, each scored by the reward. One engine call per batch (`explore`), or one
engine request per task (`prepare` / `finish`, the continuous explorer's streaming interface). With
`explorer.greedy_baseline`, `explore` makes a second engine call: one greedy (temperature 0) completion per task,
scored by the same reward (alone: a reward that compares a group's replies sees it in a group of one); its reward is
the group's `greedy_reward`, and it is not a sample.

A task with images (`takes_images`) is an `ImagePrompt` on a vision-language engine (rft.workflows.registry
`image_prompt`: the image parts, then the prompt, in the chat template's user turn; refused whole over
model.max_prompt_len, image tokens counted; dead-lettered on a text-only model); its samples carry the task's images
and the prompt text the engine's processor took. A text task on a vision-language model is explored as text."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rft.engine import ImagePrompt, SamplingSettings
from rft.schema import TaskRecord
from rft.text.chat import ChatPrompt
from rft.workflows.registry import (
    GroupResult,
    build_sample,
    generate_prompts,
    register_workflow,
    score_group,
    task_prompt,
)

if TYPE_CHECKING:
    from rft.engine import Engine, Generation
    from rft.explorer.config import ExplorerConfig
    from rft.models.config import ModelConfig
    from rft.rewards import Reward


@register_workflow("single_turn")
class SingleTurn:
    records_greedy_reward = True  # explore() records each task's greedy_reward with explorer.greedy_baseline
    takes_images = True  # tasks with images, on a vision-language model (the module docstring)

    def __init__(self, explorer: ExplorerConfig, model: ModelConfig, reward: Reward):
        self.sampling = SamplingSettings.from_config(explorer, model)
        # one greedy completion per task, as long as the samples may be (None: no greedy baseline)
        self.greedy = (dataclasses.replace(self.sampling, n=1, temperature=0.0, top_p=1.0)
                       if explorer.greedy_baseline else None)
        self.max_prompt_len = model.max_prompt_len
        self.chat = ChatPrompt.of(model)
        self.reward = reward

    def explore(self, tasks: Sequence[TaskRecord], engine: Engine) -> list[GroupResult]:
        prompts = [self.prepare(task, engine) for task in tasks]
        runnable = {i: p for i, p in enumerate(prompts) if not isinstance(p, str)}
        generations = generate_prompts(engine, runnable, self.sampling)
        results = [GroupResult(task, error=p if isinstance(p, str) else None)
                   for task, p in zip(tasks, prompts, strict=True)]
        for i, generation in generations.items():
            results[i] = self.finish(tasks[i], generation)
        if self.greedy is not None:
            scored = {i: runnable[i] for i in runnable if results[i].error is None}
            for i, generation in generate_prompts(engine, scored, self.greedy).items():
                results[i] = self._with_greedy_reward(results[i], generation)
        return results

    def _with_greedy_reward(self, result: GroupResult, greedy: Generation) -> GroupResult:
        """`result` with the reward of its task's greedy completion, or the task's error when it cannot be scored."""
        rewards = score_group(self.reward, [c.text for c in greedy.completions[:1]], result.task)
        if isinstance(rewards, str):
            return GroupResult(result.task, error=f"greedy baseline: {rewards}")
        return dataclasses.replace(result, greedy_reward=rewards[0].score)

    # -- the streaming interface of rft/explorer/continuous.py: prepare, one engine request of `sampling`, finish
    def prepare(self, task: TaskRecord, engine: Engine) -> list[int] | ImagePrompt | str:
        """The task's prompt token ids (an `ImagePrompt` for a task with images: `engine.submit_images` takes it), or
        the reason it cannot be explored."""
        return task_prompt(engine, task, self.max_prompt_len, self.chat)

    def finish(self, task: TaskRecord, generation: Generation) -> GroupResult:
        """The task's group from its n completions: scored, `policy_version` the oldest completion's version (the
        oldest token's: a completion's version is its oldest token's), each sample with its tokens' versions, and
        with the task's images and the prompt text the engine's processor took (`Generation.prompt_text`) if any."""
        completions = generation.completions
        if task.images and not generation.prompt_text:
            return GroupResult(task, error="the engine did not say which prompt text its processor took for the "
                                           "task's images (Generation.prompt_text)")
        rewards = score_group(self.reward, [c.text for c in completions], task)
        if isinstance(rewards, str):
            return GroupResult(task, error=rewards)
        prompt_text = generation.prompt_text if task.images else ""
        samples = [build_sample(k, prompt=generation.prompt_token_ids, tokens=c.token_ids, logprobs=c.logprobs,
                                loss_mask=[1] * len(c.token_ids), reward=r, finish_reason=c.finish_reason,
                                routed_experts=c.routed_experts, token_versions=c.token_versions,
                                images=task.images, prompt_text=prompt_text)
                   for k, (c, r) in enumerate(zip(completions, rewards, strict=True))]
        return GroupResult(task, samples=samples, policy_version=min(c.weights_version for c in completions))
