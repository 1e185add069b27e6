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

Turns (multi-turn credit, rft/algorithms/gigpo.py): every sample records its `turns` (rft.schema.Turn), one per
model turn: its tokens from the model's first to the last before the next model turn (the environment's reply
included), `state` the environment's `state_key()` before the model acted when it has one (FrozenLake: the
player's cell), else a digest of the token ids the model last observed (the prompt, then each observation), and
`reward` the environment's reward for the step (an environment that does not own the reward: 0, and the episode's
reward on the last turn).

Failures (docs/schema.md, "Failed rollouts"): an environment that raises anything but a `TaskError` (a server down,
a crash) when it is built or stepped fails that episode as `environment` (built: every episode of the task, with an
empty response), a `TimeoutError` from a step (an environment client's own time limit) as `timeout`; a reward
that fails marks the sample with its class (rft/rewards/registry.py). A `TaskError` is the task's fault: the
group's error, dead-lettered.

Environments are registered by name (`@register_environment`) or given as `package.module:Class`; one is built per
episode as `cls(task, reward)` (a `TaskError` there makes the group an error, not a crash) and answers
`step(model_text)`; one that needs an optional extra says which (`extra = "envs"`). Built-in: `retry` (below),
`frozenlake`, `textarena`. Observations are raw text appended after the model's turn; with `model.chat_template:
true` the prompt is rendered by the template, a model turn ends at its end-of-turn token, and each observation becomes
the next user turn and the assistant header (`rft.text.chat.observation_text`).
"""
from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rft.engine import SamplingSettings
from rft.registry import Registry
from rft.rewards.registry import RewardResult, TaskError
from rft.schema import MAX_STATE_KEY_CHARS, TaskRecord, Turn
from rft.text.chat import ChatPrompt
from rft.workflows.registry import (
    GroupResult,
    WorkflowError,
    build_sample,
    encode_prompt,
    register_workflow,
    score_group,
)

log = logging.getLogger(__name__)

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


class _NoEnvironment:
    """The environment of an episode whose environment failed to start (it is never stepped)."""

    def step(self, model_text: str) -> EnvStep:
        raise RuntimeError("no environment")


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
    failure: str = ""  # the environment failed outside the task (rft.schema.FAILURE_CLASSES): the sample is failed
    spans: list[list] = field(default_factory=list)  # [start, end, state, reward] per model turn (`turns`)
    observed: list[int] = field(default_factory=list)  # the token ids the model last observed (prompt, observation)

    def state_key(self) -> str:
        """The key of the state the model acts from now: the environment's `state_key()`, else a digest of what the
        model last observed (the prompt, then the latest observation)."""
        key = getattr(self.environment, "state_key", None)
        if callable(key):
            return str(key())[:MAX_STATE_KEY_CHARS]
        ids = self.observed or self.prompt
        return "observed:" + hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:32]

    def add_model_turn(self, c: Completion) -> None:
        if c.token_ids:
            self.spans.append([len(self.tokens), len(self.tokens) + len(c.token_ids), self.state_key(), 0.0])
        self.tokens += c.token_ids
        self.logprobs += c.logprobs
        self.mask += [1] * len(c.token_ids)
        self.versions.append(c.weights_version)
        self.last_text, self.finish_reason = c.text, c.finish_reason
        self.turns += 1

    def add_environment_turn(self, token_ids: list[int]) -> None:
        self.observed = list(token_ids)
        if self.spans:
            self.spans[-1][1] += len(token_ids)
        self.tokens += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.mask += [0] * len(token_ids)


def _turns(episode: _Episode, reward: float) -> list[Turn]:
    """The episode's `turns`; an environment that does not own the reward gets the episode's `reward` on the last."""
    turns = [Turn(start, end, state, step_reward) for start, end, state, step_reward in episode.spans]
    if turns and not owns_reward(episode.environment):
        turns[-1] = Turn(turns[-1].start, turns[-1].end, turns[-1].state, reward)
    return turns


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
            except Exception as e:  # the environment's infrastructure (a server down): every episode failed
                log.warning("environment %s for task %s failed to start: %s: %s", self.environment_cls.__name__,
                            task.task_id, type(e).__name__, e)
                episodes += [_Episode(i, k, prompt, _NoEnvironment(), done=True, failure="environment")
                             for k in range(self.sampling.n)]
                continue
            episodes += [_Episode(i, k, prompt, env) for k, env in enumerate(environments)]
        for turn in range(self.max_turns):
            active = [e for e in episodes if not e.done]
            if not active:
                break
            self._model_turn(active, engine)
            for episode in active:
                self._environment_turn(episode, engine, last_turn=turn == self.max_turns - 1)
        self._score(episodes, tasks, results, engine.weights_version)
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
        except Exception as e:  # the environment failed, not the task: this episode is a failed rollout
            log.warning("environment step failed: %s: %s", type(e).__name__, e)
            episode.done, episode.failure = True, "timeout" if isinstance(e, TimeoutError) else "environment"
            return
        episode.env_return += step.reward or 0.0
        if episode.spans:
            episode.spans[-1][3] = float(step.reward or 0.0)
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

    def _score(self, episodes: list[_Episode], tasks: Sequence[TaskRecord], results: list[GroupResult],
               engine_version: int) -> None:
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
                played = [e for e in group if not e.failure]
                scored = score_group(self.reward, [e.last_text for e in played], tasks[i]) if played else []
                if isinstance(scored, str):
                    results[i].error = scored
                    continue
                by_episode = dict(zip(map(id, played), scored, strict=True))
                rewards = [by_episode.get(id(e), RewardResult(0.0)) for e in group]
            if isinstance(rewards, str):
                results[i].error = rewards
                continue
            rewards = [RewardResult(0.0, failure=e.failure) if e.failure else r
                       for e, r in zip(group, rewards, strict=True)]
            results[i].samples = [
                build_sample(e.sample_index, prompt=e.prompt, tokens=e.tokens, logprobs=e.logprobs, loss_mask=e.mask,
                             reward=r, finish_reason=e.finish_reason or "error", metadata=_metadata(e),
                             extra_components={"turns": float(e.turns)}, turns=_turns(e, r.score))
                for e, r in zip(group, rewards, strict=True)]
            versions = [v for e in group for v in e.versions]
            results[i].policy_version = min(versions) if versions else engine_version
