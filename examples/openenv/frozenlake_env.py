"""FrozenLake as an OpenEnv environment, served by OpenEnv's own server (`create_app`): the text game of rft's
`explorer.environment: frozenlake` (rft/workflows/frozenlake.py) over OpenEnv's protocol, for rft's `openenv`
workflow (docs/data.md, "Training an OpenEnv environment"). It imports openenv and gymnasium, not rft, and runs
in .venv-openenv (`make openenv`), served by examples/openenv/server.py:

    .venv-openenv/bin/python examples/openenv/server.py frozenlake --port 8011

Equal to rft's for the same spec: reset data `{"seed", "size", "is_slippery", "p"}` (a frozenlake task's
`frozenlake` metadata) draws gymnasium's `generate_random_map(size, p, seed)` and resets FrozenLake-v1 with `seed`;
the reset observation's `text` is the task's prompt (legend, board, question), a step's `text` is `\\n` + what
happened + `\\n` + the board + the question; the action is the model's text (`message`), whose first move word
(`left`, `down`, `right`, `up`) or digit 0-3 is the move (none: `invalid move`, a step that does not move); reward
1.0 on the step that reaches the goal, else 0.0 (reset: None), done at the goal or in a hole. `board` is the board
alone (without `P`'s history line): what keys the state the model acts from.
"""
from __future__ import annotations

import re
from typing import Any

import gymnasium
from gymnasium.envs.toy_text.frozen_lake import generate_random_map
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

ACTIONS = ("left", "down", "right", "up")  # index = gymnasium's action number
_ACTION = re.compile(r"\b(left|down|right|up|[0-3])\b", re.IGNORECASE)
RULES = "Frozen lake map (P you, F ice, H hole, G goal, S start; row 1 is the top):\n"
ASK = "\nWhich way do you move to reach G without falling in a hole? Reply with one word: left, down, right or up."


class FrozenLakeAction(Action):
    message: str = Field(..., description="the model's reply; its first move word or digit 0-3 is the move")


class FrozenLakeObservation(Observation):
    text: str = Field(default="", description="what the model reads next")
    board: str = Field(default="", description="the board alone, P where the player stands")


class FrozenLakeEnvironment(Environment):
    """One FrozenLake-v1 episode per reset (see the module docstring)."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # every WebSocket session has its own instance

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self.rows: list[str] = []
        self.env: Any = None
        self.position = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, size: int = 4,
              is_slippery: bool = False, p: float = 0.8, **_: Any) -> FrozenLakeObservation:
        seed = 0 if seed is None else seed
        self.rows = list(generate_random_map(size=size, p=p, seed=seed))
        self.env = gymnasium.make("FrozenLake-v1", desc=self.rows, is_slippery=is_slippery)
        self.position, _ = self.env.reset(seed=seed)
        self._state = State(episode_id=episode_id, step_count=0)
        return FrozenLakeObservation(text=f"{RULES}{self.board()}{ASK}", board=self.board(), done=False, reward=None)

    def board(self) -> str:
        size = len(self.rows[0])
        cells = [list(r) for r in self.rows]
        cells[int(self.position) // size][int(self.position) % size] = "P"
        return "\n".join("".join(r) for r in cells)

    def step(self, action: FrozenLakeAction, timeout_s: float | None = None, **_: Any) -> FrozenLakeObservation:  # type: ignore[override]
        if self.env is None:
            raise RuntimeError("step before reset")
        self._state.step_count += 1
        match = _ACTION.search(action.message)
        if match is None:
            return FrozenLakeObservation(text=f"\ninvalid move\n{self.board()}{ASK}", board=self.board(), done=False,
                                         reward=0.0)
        word = match.group(1).lower()
        move = int(word) if word.isdigit() else ACTIONS.index(word)
        self.position, reward, terminated, truncated, _ = self.env.step(move)
        what = "goal!" if reward > 0 else ("hole" if terminated else ACTIONS[move])
        return FrozenLakeObservation(text=f"\n{what}\n{self.board()}{ASK}", board=self.board(),
                                     done=bool(terminated or truncated), reward=float(reward))

    @property
    def state(self) -> State:
        return self._state


SERVED = (FrozenLakeEnvironment, FrozenLakeAction, FrozenLakeObservation)  # what server.py hands to create_app
