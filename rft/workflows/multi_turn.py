"""multi_turn: the model and an environment take turns; environment tokens are masked out of the loss.

Episode: prompt -> model turn -> environment observation -> model turn -> ... until the environment says done,
`explorer.max_turns` model turns were taken, or the response budget (`model.max_response_len` tokens, model and
environment tokens together) is spent. A sample's response is all turns concatenated: model tokens with loss_mask 1
and their behaviour log-probs, environment tokens with loss_mask 0 and log-prob 0.

Rewards: by default the configured reward (`explorer.reward`) of the *last* model turn. An environment whose class
sets `owns_reward = True` reports rewards itself: every model turn is stepped through it and the episode's reward is
the *sum of its `EnvStep.reward`s* (None counts 0); components then add `return` and `steps`. Every sample has the
`turns` component and metadata `turns`, and `environment`: the environment's `episode_info` when it has one
(frozenlake, textarena: the episode's spec, seed included).

Environments are registered by name (`@register_environment`) or given as `package.module:Class`; one is built per
episode as `cls(task, reward)` (a `TaskError` there makes the group an error, not a crash) and answers
`step(model_text)`; one that needs an optional extra says which (`extra = "envs"`). Built-in: `retry` (below),
`frozenlake`, `textarena`. Observations are raw text appended after the model's turn; with `model.chat_template:
true` the prompt is rendered by the template, a model turn ends at its end-of-turn token, and each observation becomes
the next user turn and the assistant header (`rft.text.chat.observation_text`).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rft.engine import SamplingSettings
from rft.registry import Registry
from rft.rewards.registry import RewardResult, TaskError
from rft.schema import TaskRecord
from rft.text.chat import ChatPrompt
from rft.workflows.registry import (
    GroupResult,
    WorkflowError,
    build_sample,
    encode_prompt,
    register_workflow,
    score_group,
)

if TYPE_CHECKING:
    from rft.engine import Completion, Engine
    from rft.explorer.config import ExplorerConfig
    from rft.models.config import ModelConfig
    from rft.rewards import Reward


@dataclass(frozen=True)
class EnvStep:
    observation: str  # appended to the conversation (masked out of the loss); ignored when done
    done: bool
    reward: float | None = None  # this step's reward, for an environment with `owns_reward = True`


class Environment(Protocol):
    def step(self, model_text: str) -> EnvStep: ...


def owns_reward(environment: Any) -> bool:
    """Whether an environment (class or instance) reports the episode's rewards itself (`owns_reward = True`)."""
    return bool(getattr(environment, "owns_reward", False))


def needs_extra(environment: Any) -> str | None:
    """The optional extra (rft/extras.py) whose modules an environment (class or instance) imports when it is built
    (`extra = "envs"`), or None; a config that names the environment is checked for it when it loads."""
    return getattr(environment, "extra", None)


ENVIRONMENTS: Registry[Any] = Registry("environment", noun="environment", error=WorkflowError)
register_environment = ENVIRONMENTS.register  # class decorator: `explorer.environment: <name>`


@register_environment("retry")
class RetryEnvironment:
    """Scores each model turn with the run's reward; a perfect score ends the episode, anything else
    gets the score back and another try."""

    def __init__(self, task: TaskRecord, reward: Reward):
        self.task, self.reward = task, reward

    def step(self, model_text: str) -> EnvStep:
        score = self.reward.score([model_text], self.task)[0].score
        return EnvStep(observation=f"\nscore {score:.2f}, try again:\n", done=score >= 1.0)


@dataclass
class _Episode:
    """One sample's conversation so far."""
    task_index: int
    sample_index: int
    prompt: list[int]
    environment: Environment
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    last_text: str = ""
    finish_reason: str = ""
    turns: int = 0
    done: bool = False
    env_return: float = 0.0  # sum of the environment's step rewards (environments that own the reward)
    env_steps: int = 0
    error: str | None = None  # a TaskError the environment raised

    def add_model_turn(self, c: Completion) -> None:
        self.tokens += c.token_ids
        self.logprobs += c.logprobs
        self.mask += [1] * len(c.token_ids)
        self.versions.append(c.weights_version)
        self.last_text, self.finish_reason = c.text, c.finish_reason
        self.turns += 1

    def add_environment_turn(self, token_ids: list[int]) -> None:
        self.tokens += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.mask += [0] * len(token_ids)


def _metadata(episode: _Episode) -> dict[str, Any]:
    """A sample's metadata: `turns`, and the environment's `episode_info` (e.g. its seed) when it has one."""
    info = getattr(episode.environment, "episode_info", None)
    return {"turns": episode.turns, **({"environment": dict(info)} if info else {})}


@register_workflow("multi_turn")
class MultiTurn:
    def __init__(self, explorer: ExplorerConfig, model: ModelConfig, reward: Reward):
        self.sampling = SamplingSettings.from_config(explorer, model)
        self.max_prompt_len = model.max_prompt_len
        self.chat = ChatPrompt.of(model)
        self.max_response_len = model.max_response_len
        self.max_turns = explorer.max_turns
        self.environment_cls = ENVIRONMENTS.resolve(explorer.environment, key="explorer.environment")
        self.reward = reward

    def explore(self, tasks: Sequence[TaskRecord], engine: Engine) -> list[GroupResult]:
        results = [GroupResult(task) for task in tasks]
        episodes = []
        for i, task in enumerate(tasks):
            prompt = encode_prompt(engine, task, self.max_prompt_len, self.chat)
            if isinstance(prompt, str):
                results[i].error = prompt
                continue
            try:
                environments = [self.environment_cls(task, self.reward) for _ in range(self.sampling.n)]
            except TaskError as e:
                results[i].error = f"task cannot be explored: {e}"
                continue
            episodes += [_Episode(i, k, prompt, env) for k, env in enumerate(environments)]
        for turn in range(self.max_turns):
            active = [e for e in episodes if not e.done]
            if not active:
                break
            self._model_turn(active, engine)
            for episode in active:
                self._environment_turn(episode, engine, last_turn=turn == self.max_turns - 1)
        self._score(episodes, tasks, results)
        return results

    def _model_turn(self, episodes: list[_Episode], engine: Engine) -> None:
        by_budget: dict[int, list[_Episode]] = defaultdict(list)
        for e in episodes:
            by_budget[min(self.sampling.max_tokens, self.max_response_len - len(e.tokens))].append(e)
        for budget, batch in by_budget.items():
            settings = SamplingSettings(n=1, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                        max_tokens=budget)
            generations = engine.generate([e.prompt + e.tokens for e in batch], settings)
            for episode, generation in zip(batch, generations, strict=True):
                episode.add_model_turn(generation.completions[0])

    def _environment_turn(self, episode: _Episode, engine: Engine, *, last_turn: bool) -> None:
        out_of_budget = last_turn or len(episode.tokens) >= self.max_response_len
        if out_of_budget and not owns_reward(episode.environment):
            episode.done = True
            return
        try:
            step = episode.environment.step(episode.last_text)
        except TaskError as e:  # the task cannot be scored: _score reports it as the group's error
            episode.done, episode.error = True, str(e)
            return
        episode.env_return += step.reward or 0.0
        episode.env_steps += 1
        if out_of_budget:  # the last action was applied (its reward counts); nothing follows it
            episode.done = True
            return
        observation = engine.encode_observation(step.observation, self.chat) if not step.done else []
        # an observation must leave room for at least one model token
        if step.done or len(episode.tokens) + len(observation) >= self.max_response_len:
            episode.done = True
            return
        episode.add_environment_turn(observation)

    def _score(self, episodes: list[_Episode], tasks: Sequence[TaskRecord], results: list[GroupResult]) -> None:
        by_task: dict[int, list[_Episode]] = defaultdict(list)
        for e in episodes:
            by_task[e.task_index].append(e)
        for i, group in by_task.items():
            errors = [e.error for e in group if e.error]
            if errors:
                results[i].error = f"task cannot be scored: {errors[0]}"
                continue
            rewards: list[RewardResult] | str
            if owns_reward(self.environment_cls):
                rewards = [RewardResult(e.env_return, {"return": e.env_return, "steps": float(e.env_steps)})
                           for e in group]
            else:
                rewards = score_group(self.reward, [e.last_text for e in group], tasks[i])
            if isinstance(rewards, str):
                results[i].error = rewards
                continue
            results[i].samples = [
                build_sample(e.sample_index, prompt=e.prompt, tokens=e.tokens, logprobs=e.logprobs, loss_mask=e.mask,
                             reward=r, finish_reason=e.finish_reason, metadata=_metadata(e),
                             extra_components={"turns": float(e.turns)})
                for e, r in zip(group, rewards, strict=True)]
            results[i].policy_version = min(v for e in group for v in e.versions)
