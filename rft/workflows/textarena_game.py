"""textarena: a single-player TextArena game as a multi-turn environment (`explorer.environment: textarena`).

Tasks: `data.format: generated`, `data.path: textarena` (rft/data/toy_tasks.py), `data.options.env_id`
(default `GuessTheNumber-v0-raw`: guess a number in 1..20 within 10 turns, answering `[n]`; any single-player
TextArena id whose game runs offline works, a `-raw` id keeps the game's own text unwrapped). Each row carries
`{"env_id", "seed"}` as the `textarena` metadata field; every episode of a group is reset with that seed, so they
all play the same game (the same secret number). TextArena seeds Python's global `random` on reset and draws
from it; the environment keeps its own random state and swaps it in around every call into the game, so
episodes stepped in turn (as the workflow does) never disturb each other or the process.

Text: the prompt is the game's opening prompt observation; after each model turn the observation is `\\n` + the
game's messages of that step (for GuessTheNumber `The target number is lower.`, or its invalid-move notice), one
per line, + `\\n`. The model's whole turn is the action (the game parses it: `[7]`).

Reward: the environment owns it (`owns_reward`): the game's reward for player 0 on the step that ends the game
(GuessTheNumber: 1 for the number, else at the turn limit or on a second invalid move in a row
`1 - |last guess - number| / 19`, in [0, 1]); 0 when the workflow's turns or budget run out first. Other games'
rewards are passed on as the game gives them (some pay -1 for a loss, outside the usual [0, 1]).

textarena is the `envs` extra (rft/extras.py): imported when a game is made, so the environment is registered
without it, and a config that names it without the extra fails when it loads, naming the key.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rft.extras import require
from rft.rewards.registry import TaskError
from rft.schema import TaskRecord
from rft.workflows.multi_turn import EnvStep, register_environment

if TYPE_CHECKING:
    from rft.rewards import Reward

METADATA_KEY = "textarena"
DEFAULT_ENV_ID = "GuessTheNumber-v0-raw"
GAME = -1  # TextArena's sender id of the game's own messages


def check_options(options: dict[str, Any], error: type[Exception] = ValueError) -> dict[str, Any]:
    """`data.options` of a textarena task set (`env_id`) with the default filled in."""
    unknown = set(options) - {"env_id"}
    if unknown:
        raise error(f"textarena takes the option 'env_id'; unknown {sorted(unknown)}")
    env_id = options.get("env_id", DEFAULT_ENV_ID)
    if not isinstance(env_id, str) or not env_id:
        raise error(f"textarena option env_id must be a TextArena environment id; got {env_id!r}")
    return {"env_id": env_id}


class Game:
    """One seeded TextArena game with a private random state; `call` runs a game method under it."""

    def __init__(self, env_id: str, seed: int):
        textarena = require("textarena", feature="textarena")  # imports its whole game catalogue (0.5 s)

        try:
            self.env = textarena.make(env_id)
        except Exception as e:  # textarena raises ValueError for an unknown id, anything from a game's __init__
            raise TaskError(f"textarena cannot make {env_id!r}: {e}") from None
        self._state = random.Random(seed).getstate()
        self.call(lambda: self.env.reset(num_players=1, seed=seed))

    def call(self, fn: Callable[[], Any]) -> Any:
        outside = random.getstate()
        random.setstate(self._state)
        try:
            return fn()
        finally:
            self._state = random.getstate()
            random.setstate(outside)

    def messages(self) -> list[str]:
        """The game's messages to player 0 since the last call (its own echo of the player's action left out)."""
        _, observations = self.call(self.env.get_observation)
        return [message for sender, message, *_ in observations if sender == GAME]


def textarena_row(rng: random.Random, options: dict[str, Any]) -> dict[str, Any]:
    """One task row: the game's opening prompt (the game made with the row's seed), the spec as `textarena`."""
    env_id = check_options(options)["env_id"]
    seed = rng.randrange(2 ** 31)
    try:
        prompt = "\n".join(Game(env_id, seed).messages())
    except TaskError as e:
        raise ValueError(str(e)) from None
    return {"prompt": prompt, "answer": "", METADATA_KEY: {"env_id": env_id, "seed": seed}}


@register_environment("textarena")
class TextArenaEnvironment:
    """One episode of the task's TextArena game (see the module docstring)."""

    owns_reward = True
    extra = "envs"  # textarena

    def __init__(self, task: TaskRecord, reward: Reward | None = None):
        spec = task.metadata.get(METADATA_KEY)
        if not isinstance(spec, dict) or set(spec) != {"env_id", "seed"} or not isinstance(spec["seed"], int):
            raise TaskError(f"task metadata {METADATA_KEY!r} must be {{'env_id': str, 'seed': int}}; got {spec!r}")
        self.game = Game(check_options({"env_id": spec["env_id"]}, error=TaskError)["env_id"], spec["seed"])
        self.game.messages()  # the opening prompt is the task's prompt
        self.episode_info = {"env_id": spec["env_id"], "seed": spec["seed"]}  # sample metadata

    def step(self, model_text: str) -> EnvStep:
        done, _ = self.game.call(lambda: self.game.env.step(model_text))
        observation = "\n" + "".join(f"{m}\n" for m in self.game.messages())
        if not done:
            return EnvStep(observation, done=False, reward=0.0)
        rewards, _ = self.game.call(self.game.env.close)
        return EnvStep(observation, done=True, reward=float((rewards or {}).get(0, 0.0)))
