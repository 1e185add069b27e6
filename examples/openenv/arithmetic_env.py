"""reasoning-gym questions (the quickstart's arithmetic) as an OpenEnv environment, served by OpenEnv's own server
(`create_app`) for rft's `openenv` workflow: the task of configs/smollm2-arithmetic.yaml played over OpenEnv's
protocol (configs/smollm2-arithmetic-openenv.yaml; docs/data.md, "Training an OpenEnv environment"). It imports
openenv and reasoning_gym, not rft, and runs in .venv-openenv (`make openenv`), served by
examples/openenv/server.py:

    .venv-openenv/bin/python examples/openenv/server.py arithmetic --port 8013 \\
        --option "prompt_template={prompt} Reply with only the final number."

One step per episode, scored as rft's `reasoning_gym` reward scores the reply (rft/rewards/reasoning_gym.py):
- reset data: a reasoning_gym task's `reasoning_gym` metadata, `{"dataset", "options", "seed", "size", "index"}`
  (rft/data/gym_tasks.py GymSpec): entry `index` of `reasoning_gym.create_dataset(dataset, seed=seed, size=size,
  **options)`. Each field's type is checked and `index` must lie in [0, size); a bad spec is an error frame.
- the reset observation's `text` is the prompt exactly as rft's task carries it: `prompt_template` (a server
  option, default "{prompt}") formatted with the entry's question as `prompt` (and `answer`, `reasoning_gym` as an
  rft task row has them);
- the step's action is the reply (`message`); its reward is the dataset's own `score_answer` of the reply's last
  number (an optional minus sign, thousands separators dropped, a decimal part kept), clamped to [0, 1], 0.0 when
  the reply has no number; done is true. The observation also carries `extracted` (the number scored, "" for none).
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any

import reasoning_gym
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")  # as rft/rewards/text.py `last_number`
MAX_SIZE = 1_000_000  # a spec's dataset size beyond this is refused (the dataset is built from it)
SPEC_TYPES = {"dataset": str, "options": dict, "seed": int, "size": int, "index": int}


class ArithmeticAction(Action):
    message: str = Field(..., description="the model's reply; its last number is the answer")


class ArithmeticObservation(Observation):
    text: str = Field(default="", description="the prompt (reset); empty after the step")
    extracted: str = Field(default="", description="the number the step scored (\"\": none)")


def last_number(reply: str) -> str | None:
    """The reply's last number ("= -1,234.50." -> "-1234.50"), or None when it has none."""
    found = _NUMBER.findall(reply)
    return found[-1].replace(",", "") if found else None


@functools.lru_cache(maxsize=64)
def _dataset(name: str, options_json: str, seed: int, size: int) -> Any:
    return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(options_json))


def check_spec(spec: dict[str, Any]) -> None:
    """ValueError naming the reset field that is missing, of the wrong type or out of range."""
    for name, tp in SPEC_TYPES.items():
        value = spec.get(name)
        if not isinstance(value, tp) or isinstance(value, bool):
            raise ValueError(f"reset data {name!r}: expected {tp.__name__}, got {str(value)[:100]}")
    if not 0 < spec["size"] <= MAX_SIZE or not 0 <= spec["index"] < spec["size"]:
        raise ValueError(f"reset data: index {spec['index']} must lie in [0, size) and size in (0, {MAX_SIZE}]")
    if "seed" in spec["options"] or "size" in spec["options"]:
        raise ValueError("reset data options: seed and size are the spec's own fields")


class ArithmeticEnvironment(Environment):
    """One reasoning-gym question per reset, one scored reply per episode (see the module docstring)."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # every WebSocket session has its own instance

    def __init__(self, prompt_template: str = "{prompt}") -> None:
        super().__init__()
        try:  # a template that cannot format fails the server's start (server.py builds one first), not episodes
            prompt_template.format(prompt="", answer="", reasoning_gym={})
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"prompt_template {prompt_template!r} does not format: {type(e).__name__}: {e}") from None
        self.prompt_template = prompt_template
        self._state = State(step_count=0)
        self.dataset: Any = None
        self.entry: dict[str, Any] | None = None

    def reset(self, seed: int | None = None, episode_id: str | None = None, dataset: str = "", options: Any = None,
              size: int = 0, index: int = -1, **_: Any) -> ArithmeticObservation:
        spec = {"dataset": dataset, "options": options, "seed": seed, "size": size, "index": index}
        check_spec(spec)
        self.dataset = _dataset(dataset, json.dumps(options, sort_keys=True), seed, size)
        self.entry = self.dataset[index]
        self._state = State(episode_id=episode_id, step_count=0)
        row = {"prompt": self.entry["question"], "answer": self.entry["answer"], "reasoning_gym": spec}
        return ArithmeticObservation(text=self.prompt_template.format(**row), done=False, reward=None)

    def step(self, action: ArithmeticAction, timeout_s: float | None = None, **_: Any) -> ArithmeticObservation:  # type: ignore[override]
        if self.entry is None:
            raise RuntimeError("step before reset, or after the episode's one step")
        entry, self.entry = self.entry, None
        self._state.step_count += 1
        extracted = last_number(action.message)
        score = 0.0 if extracted is None else min(1.0, max(0.0, float(self.dataset.score_answer(extracted, entry))))
        return ArithmeticObservation(text="", extracted=extracted or "", done=True, reward=score)

    @property
    def state(self) -> State:
        return self._state


SERVED = (ArithmeticEnvironment, ArithmeticAction, ArithmeticObservation)
