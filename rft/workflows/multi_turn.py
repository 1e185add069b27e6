"""multi_turn: the model and an environment take turns; environment tokens are masked out of the loss.

Episode: prompt -> model turn -> environment observation -> model turn -> ... until the environment says done,
`explorer.max_turns` model turns were taken, or the response budget (`model.max_response_len` tokens, model and
environment tokens together) is spent. A sample's response is all turns concatenated: model tokens with loss_mask 1
and their behaviour log-probs, environment tokens with loss_mask 0 and log-prob 0.

Rewards: by default the configured reward (`explorer.reward`) of the *last* model turn. An environment whose class
sets `owns_reward = True` reports rewards itself: every model turn is stepped through it and the episode's reward is
the *sum of its `EnvStep.reward`s* (None counts 0 on a step within the episode); components then add `return` and
`steps`. Such an episode is `unscored` (a failed sample, below) when the step that ends it (done) has reward None or
no step had one. Every sample has the `turns` component and metadata `turns`, and `environment`: the environment's
`episode_info` when it has one (frozenlake, textarena: the episode's spec, seed included).

Turns: each sample records its steps (`Sample.turns`): a step's tokens are the model's turn and the observation
after it, its `state` the key of the state the model acted from (the environment's `state_key()` when it has one,
else a hash of the text the model read last: the prompt or the previous observation), its reward the step's.

Failures: an environment that fails outside the policy's doing raises `RolloutFailure(failure, message)` when it is
built or stepped (`failure` one of rft.schema.FAILURE_CLASSES: a server down, a timeout); the episode ends there
and its sample is kept with that `failure` and no reward (not trained, left out of the group's baseline; metadata
`failure_detail` says what happened). A `TaskError` instead fails the whole group (the task cannot be explored).

Environments are registered by name (`@register_environment`) or given as `package.module:Class`; one is built per
episode as `cls(task, reward)` (a `TaskError` there makes the group an error, not a crash) and answers
`step(model_text)`; one that needs an optional extra says which (`extra = "envs"`). Optional: `prompt` (a string:
the episode's prompt instead of the task's, e.g. a remote environment's reset observation), `state_key()`, and
`close()`, called when the batch is done. Built-in: `retry` (below),
`frozenlake`, `textarena`. Observations are raw text appended after the model's turn; with `model.chat_template:
true` the prompt is rendered by the template, a model turn ends at its end-of-turn token, and each observation becomes
the next user turn and the assistant header (`rft.text.chat.observation_text`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rft.engine import SamplingSettings
from rft.registry import Registry
from rft.rewards.registry import RewardResult, TaskError
from rft.schema import FAILURE_CLASSES, MAX_STATE_KEY_CHARS, Sample, TaskRecord, Turn
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


log = logging.getLogger(__name__)
FAILURE_DETAIL_CHARS = 300  # of a failed sample's metadata `failure_detail`


class RolloutFailure(Exception):
    """An episode failed outside the policy's doing: `failure` is one of rft.schema.FAILURE_CLASSES (the module
    docstring, "Failures")."""

    def __init__(self, failure: str, message: str):
        if failure not in FAILURE_CLASSES:
            raise ValueError(f"failure {failure!r} is not one of {FAILURE_CLASSES}")
        super().__init__(message)
        self.failure = failure


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


def state_key(environment: Any, text: str) -> str:
    """The key of the state the model acts from next: the environment's `state_key()` when it has one, else the
    SHA-256 of `text`, what the model read last (the prompt, or the observation)."""
    own = getattr(environment, "state_key", None)
    return str(own())[:MAX_STATE_KEY_CHARS] if callable(own) else hashlib.sha256(text.encode()).hexdigest()


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
    """One sample's conversation so far; `environment` None when building it failed (`failure`)."""
    task_index: int
    sample_index: int
    prompt: list[int]
    environment: Environment | None
    state: str = ""  # the key of the state the model acts from next
    steps: list[Turn] = field(default_factory=list)  # the sample's turns so far
    failure: str = ""  # a RolloutFailure's class: the sample is kept without a reward
    failure_detail: str = ""
    scored_steps: int = 0  # steps whose reward was not None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    last_text: str = ""
    last_tokens: list[int] = field(default_factory=list)  # the last model turn's
    finish_reason: str = ""
    turns: int = 0
    done: bool = False
    env_return: float = 0.0  # sum of the environment's step rewards (environments that own the reward)
    env_steps: int = 0
    error: str | None = None  # a TaskError the environment raised

    def fail(self, e: RolloutFailure) -> None:
        self.done, self.failure, self.failure_detail = True, e.failure, str(e)[:FAILURE_DETAIL_CHARS]

    def add_model_turn(self, c: Completion) -> None:
        self.last_tokens = c.token_ids
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
    """A sample's metadata: `turns`, the environment's `episode_info` (e.g. its seed) when it has one, and a failed
    episode's `failure_detail`."""
    info = getattr(episode.environment, "episode_info", None)
    return {"turns": episode.turns, **({"environment": dict(info)} if info else {}),
            **({"failure_detail": episode.failure_detail} if episode.failure else {})}


def _close(environment: Any) -> None:
    close = getattr(environment, "close", None)
    if callable(close):
        close()


@register_workflow("multi_turn")
class MultiTurn:
    def __init__(self, explorer: ExplorerConfig, model: ModelConfig, reward: Reward):
        self.sampling = SamplingSettings.from_config(explorer, model)
        self.max_prompt_len = model.max_prompt_len
        self.chat = ChatPrompt.of(model)
        self.max_response_len = model.max_response_len
        self.max_turns = explorer.max_turns
        self.environment_cls: Any = ENVIRONMENTS.resolve(explorer.environment, key="explorer.environment")
        self.environment_owns_reward = owns_reward(self.environment_cls)
        self.reward = reward

    def explore(self, tasks: Sequence[TaskRecord], engine: Engine) -> list[GroupResult]:
        results = [GroupResult(task) for task in tasks]
        episodes: list[_Episode] = []
        try:
            for i, task in enumerate(tasks):
                group = self._start(i, task, engine)
                if isinstance(group, str):
                    results[i].error = group
                else:
                    episodes += group
            for turn in range(self.max_turns):
                active = [e for e in episodes if not e.done]
                if not active:
                    break
                self._model_turn(active, engine)
                for episode in active:
                    self._environment_turn(episode, engine, last_turn=turn == self.max_turns - 1)
        finally:
            for episode in episodes:
                _close(episode.environment)
        self._score(episodes, tasks, results, engine)
        return results

    def _start(self, i: int, task: TaskRecord, engine: Engine) -> list[_Episode] | str:
        """The task's `n` episodes, their environments built (a RolloutFailure fails that episode only), or why the
        task cannot be explored (the group's error)."""
        environments: list[Environment | RolloutFailure] = []
        try:
            for _ in range(self.sampling.n):
                try:
                    environments.append(self.environment_cls(task, self.reward))
                except RolloutFailure as e:
                    environments.append(e)
                except TaskError:
                    raise
                except Exception as e:  # the environment's infrastructure (a server down), not the task
                    log.warning("environment %s for task %s failed to start: %s: %s", self.environment_cls.__name__,
                                task.task_id, type(e).__name__, e)
                    environments.append(RolloutFailure("environment", f"{type(e).__name__}: {e}"))
        except TaskError as e:
            for env in environments:
                _close(env)
            return f"task cannot be explored: {e}"
        prompts: dict[str, list[int] | str] = {}  # by prompt text: the environments' own prompts, else the task's
        episodes = []
        for k, env in enumerate(environments):
            text = task.prompt if isinstance(env, RolloutFailure) else getattr(env, "prompt", None) or task.prompt
            if text not in prompts:
                prompts[text] = encode_prompt(engine, dataclasses.replace(task, prompt=text), self.max_prompt_len,
                                              self.chat)
            prompt = prompts[text]
            if isinstance(prompt, str):
                for other in environments:
                    _close(other)
                return prompt
            if isinstance(env, RolloutFailure):
                episode = _Episode(i, k, prompt, None)
                episode.fail(env)
            else:
                episode = _Episode(i, k, prompt, env, state=state_key(env, text))
            episodes.append(episode)
        return episodes

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
        """Step the environment with the model's last turn and record the step (`Sample.turns`): from the model
        turn's first token to the end of the observation appended after it."""
        start, state = len(episode.tokens) - len(episode.last_tokens), episode.state
        reward = self._step(episode, engine, last_turn=last_turn)
        if len(episode.tokens) > start:
            episode.steps.append(Turn(start=start, end=len(episode.tokens), state=state, reward=reward or 0.0))

    def _step(self, episode: _Episode, engine: Engine, *, last_turn: bool) -> float | None:
        """The environment's turn after the model's; the step's reward (None: none)."""
        out_of_budget = last_turn or len(episode.tokens) >= self.max_response_len
        environment = episode.environment
        assert environment is not None  # an episode without one failed when it was built (done)
        if out_of_budget and not owns_reward(environment):
            episode.done = True
            return None
        try:
            step = environment.step(episode.last_text)
        except TaskError as e:  # the task cannot be scored: _score reports it as the group's error
            episode.done, episode.error = True, str(e)
            return None
        except RolloutFailure as e:
            episode.fail(e)
            return None
        except Exception as e:  # the environment failed, not the task (a TimeoutError: its client's own limit)
            log.warning("environment step failed: %s: %s", type(e).__name__, e)
            episode.fail(RolloutFailure("timeout" if isinstance(e, TimeoutError) else "environment",
                                        f"{type(e).__name__}: {e}"))
            return None
        episode.env_return += step.reward or 0.0
        episode.env_steps += 1
        episode.scored_steps += step.reward is not None
        if step.done and step.reward is None and owns_reward(environment):
            episode.fail(RolloutFailure("unscored", f"the environment ended the episode at step {episode.env_steps} "
                                        "without a reward"))
            return None
        if out_of_budget:  # the last action was applied (its reward counts); nothing follows it
            episode.done = True
            return step.reward
        observation = engine.encode_observation(step.observation, self.chat) if not step.done else []
        # an observation must leave room for at least one model token
        if step.done or len(episode.tokens) + len(observation) >= self.max_response_len:
            episode.done = True
            return step.reward
        episode.add_environment_turn(observation)
        episode.state = state_key(environment, step.observation)
        return step.reward

    def _score(self, episodes: list[_Episode], tasks: Sequence[TaskRecord], results: list[GroupResult],
               engine: Engine) -> None:
        by_task: dict[int, list[_Episode]] = defaultdict(list)
        for e in episodes:
            by_task[e.task_index].append(e)
            if self.environment_owns_reward and not e.failure and not e.error and not e.scored_steps:
                e.fail(RolloutFailure("unscored", f"the environment gave no reward in {e.env_steps} steps"))
        failures = Counter(e.failure for e in episodes if e.failure)
        if failures:
            log.warning("%d of %d episodes failed (%s); first: %s", sum(failures.values()), len(episodes),
                        ", ".join(f"{k} {v}" for k, v in sorted(failures.items())),
                        next(e.failure_detail for e in episodes if e.failure))
        for i, group in by_task.items():
            errors = [e.error for e in group if e.error]
            if errors:
                results[i].error = f"task cannot be scored: {errors[0]}"
                continue
            scored = [e for e in group if not e.failure]
            rewards: list[RewardResult] | str = []
            if self.environment_owns_reward:
                rewards = [RewardResult(e.env_return, {"return": e.env_return, "steps": float(e.env_steps)})
                           for e in scored]
            elif scored:
                rewards = score_group(self.reward, [e.last_text for e in scored], tasks[i])
            if isinstance(rewards, str):
                results[i].error = rewards
                continue
            by_episode = dict(zip((id(e) for e in scored), rewards, strict=True))
            results[i].samples = [self._sample(e, by_episode.get(id(e))) for e in group]
            results[i].policy_version = min((v for e in group for v in e.versions), default=engine.weights_version)

    @staticmethod
    def _sample(e: _Episode, reward: RewardResult | None) -> Sample:
        """The episode's sample; `reward` None for a failed episode (kept with its `failure`, no reward), or one
        whose reward failed (its `failure`: verifier, unscored, timeout). An environment that does not own the reward
        gives its last turn the episode's reward (GiGPO's step return)."""
        reward = reward or RewardResult(0.0, {}, failure=e.failure)
        turns = list(e.steps)
        if turns and not reward.failure and e.environment is not None and not owns_reward(e.environment):
            turns[-1] = dataclasses.replace(turns[-1], reward=reward.score)
        return build_sample(e.sample_index, prompt=e.prompt, tokens=e.tokens, logprobs=e.logprobs, loss_mask=e.mask,
                            reward=reward, finish_reason=e.finish_reason, metadata=_metadata(e),
                            extra_components={"turns": float(e.turns)}, turns=turns or None)
