"""An echo environment for rft's OpenEnv protocol tests (tests/integration/test_openenv.py), served by
examples/openenv/server.py in .venv-openenv. It imports openenv, not rft.

Reset data (all optional) shapes the episode: `steps` (default 2; under 1: the reset fails) steps, the last one done
with reward `final_reward` (default 1.0; null: an unscored episode), the others with `step_reward` (default 0.0;
null: none); `fail_at` (1-based step, 0: never) raises there (OpenEnv answers an error frame); `hang_at` sleeps
`hang_s` seconds (default 30) there, past a client's step timeout. Observation `text`: the reset's greeting, then
each step's `\\n` + the first 40 characters of the action's `message` + `\\n`.
"""
from __future__ import annotations

import time
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class EchoAction(Action):
    message: str = Field(..., description="echoed back")


class EchoObservation(Observation):
    text: str = Field(default="", description="what the model reads next")


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self.plan: dict[str, Any] = {}

    def reset(self, seed: int | None = None, episode_id: str | None = None, steps: int = 2,
              final_reward: float | None = 1.0, step_reward: float | None = 0.0, fail_at: int = 0, hang_at: int = 0,
              hang_s: float = 30.0, **_: Any) -> EchoObservation:
        if steps < 1:
            raise ValueError(f"echo: steps must be at least 1, got {steps}")
        self.plan = {"steps": steps, "final_reward": final_reward, "step_reward": step_reward, "fail_at": fail_at,
                     "hang_at": hang_at, "hang_s": hang_s}
        self._state = State(episode_id=episode_id, step_count=0)
        return EchoObservation(text="Say anything:", done=False, reward=None)

    def step(self, action: EchoAction, timeout_s: float | None = None, **_: Any) -> EchoObservation:  # type: ignore[override]
        self._state.step_count += 1
        k = self._state.step_count
        if k == self.plan["fail_at"]:
            raise RuntimeError(f"echo: failing at step {k} as asked")
        if k == self.plan["hang_at"]:
            time.sleep(self.plan["hang_s"])
        done = k >= self.plan["steps"]
        return EchoObservation(text=f"\n{action.message[:40]}\n", done=done,
                               reward=self.plan["final_reward"] if done else self.plan["step_reward"])

    @property
    def state(self) -> State:
        return self._state


SERVED = (EchoEnvironment, EchoAction, EchoObservation)
