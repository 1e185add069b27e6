"""Shared by the environment tests: a multi-turn sample cut back into its turns, and an episode replayed in a fresh
environment (the independent reference for the reward and the observations)."""
from __future__ import annotations

import itertools
from typing import Any

from rft.schema import Sample


def split_turns(sample: Sample) -> list[tuple[int, list[int]]]:
    """The response as (loss_mask, token ids) runs in order: 1 = a model turn, 0 = an environment observation."""
    turns, start = [], 0
    for mask, run in itertools.groupby(sample.loss_mask.tolist()):
        n = len(list(run))
        turns.append((mask, sample.response_tokens[start:start + n].tolist()))
        start += n
    return turns


def replay(environment: Any, model_turns: list[str]) -> tuple[float, list[str]]:
    """Step a fresh environment through the model's turns: the return (sum of step rewards) and the observations
    of the steps that did not end the episode."""
    total, observations = 0.0, []
    for text in model_turns:
        step = environment.step(text)
        total += step.reward or 0.0
        if step.done:
            break
        observations.append(step.observation)
    return total, observations


class CountingEnvironment:
    """A test environment that owns its reward: step k (from 1) rewards `len(model_text) % 3 / 10` and observes
    `"\\nstep k\\n"`; the episode ends after 3 steps. Named in configs as `tests.episodes:CountingEnvironment`."""

    owns_reward = True

    def __init__(self, task: Any, reward: Any = None):
        self.steps = 0

    def step(self, model_text: str) -> Any:
        from rft.workflows.multi_turn import EnvStep

        self.steps += 1
        return EnvStep(f"\nstep {self.steps}\n", done=self.steps == 3, reward=len(model_text) % 3 / 10)


class BrokenEnvironment(CountingEnvironment):
    """CountingEnvironment whose server goes away: its second step raises ConnectionError (an infrastructure
    failure, not the task's). Named in configs as `tests.episodes:BrokenEnvironment`."""

    def step(self, model_text: str) -> Any:
        if self.steps == 1:
            raise ConnectionError("environment server closed the connection")
        return super().step(model_text)


class SlowEnvironment(CountingEnvironment):
    """CountingEnvironment whose client gives up on its server: its second step raises TimeoutError."""

    def step(self, model_text: str) -> Any:
        if self.steps == 1:
            raise TimeoutError("environment server did not answer within 30 s")
        return super().step(model_text)


class UnreachableEnvironment(CountingEnvironment):
    """An environment whose server cannot be reached: building it raises ConnectionError."""

    def __init__(self, task: Any, reward: Any = None):
        raise ConnectionError("environment server refused the connection")
