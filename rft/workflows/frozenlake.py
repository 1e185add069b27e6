"""frozenlake: gymnasium's FrozenLake-v1 as a multi-turn environment (`explorer.environment: frozenlake`).

Tasks: `data.format: generated`, `data.path: frozenlake` (rft/data/toy_tasks.py), `data.options` among
`size` (board side, default 4), `is_slippery` (default false), `p` (probability a generated cell is frozen,
default 0.8). Each task row carries its episode spec as the `frozenlake` metadata field
`{"seed", "size", "is_slippery", "p"}`: the map is `generate_random_map(size, p, seed)` and the environment is
reset with `seed`, so every episode of a group (every sample of the task) plays the same map with the same
randomness (the slips of a slippery lake still depend on the actions taken).

Text: the board is `size` lines of `size` characters, row 0 first: `S` start, `F` frozen, `H` hole, `G` goal, and
`P` where the player stands (over whatever is there). The prompt is a legend line, the board and the question
(`ASK`); after a model turn the observation is `\\n` + what happened + `\\n` + the board + the question. The
action is the first of the words `left`, `down`, `right`, `up` (any case) or a standalone digit `0`-`3` (gymnasium's
action numbers: 0 left, 1 down, 2 right, 3 up) in the model's text; a text with none is an invalid action: the board
is shown again with an error line, and it counts as a step (the player does not move). Never a crash.

Reward: the environment owns it (`owns_reward`): the episode's return, 1 on the step that reaches the goal and
0 otherwise (falling in a hole ends the episode with 0). The episode ends at the goal or in a hole, or when the
workflow's `explorer.max_turns` / response budget runs out.

gymnasium is the `envs` extra (rft/extras.py): imported when a map or an environment is made, so the environment is
registered without it, and a config that names it without the extra fails when it loads, naming the key.
"""
from __future__ import annotations

import collections
import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rft.extras import require
from rft.rewards.registry import TaskError
from rft.schema import TaskRecord
from rft.workflows.multi_turn import EnvStep, register_environment

if TYPE_CHECKING:
    from rft.rewards import Reward

METADATA_KEY = "frozenlake"
ACTIONS = ("left", "down", "right", "up")  # index = gymnasium's action number
MOVES = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}  # gymnasium's action -> (d row, d column)
_ACTION = re.compile(r"\b(left|down|right|up|[0-3])\b", re.IGNORECASE)
DEFAULTS = {"size": 4, "is_slippery": False, "p": 0.8}
RULES = "Frozen lake map (P you, F ice, H hole, G goal, S start; row 1 is the top):\n"
ASK = "\nWhich way do you move to reach G without falling in a hole? Reply with one word: left, down, right or up."


@dataclass(frozen=True)
class LakeSpec:
    """One episode's lake: the map comes from (size, p, seed), the environment's randomness from seed."""
    seed: int
    size: int = 4
    is_slippery: bool = False
    p: float = 0.8

    @classmethod
    def of(cls, spec: Any) -> LakeSpec:
        """The spec of a task's `frozenlake` metadata; TaskError naming what is wrong."""
        if not isinstance(spec, dict) or not isinstance(spec.get("seed"), int):
            raise TaskError(f"task metadata {METADATA_KEY!r} must be a mapping with an int 'seed'; got {spec!r}")
        unknown = set(spec) - {"seed", *DEFAULTS}
        if unknown:
            raise TaskError(f"task metadata {METADATA_KEY!r} has unknown keys {sorted(unknown)}")
        lake = cls(**spec)
        check_options({k: v for k, v in spec.items() if k != "seed"}, error=TaskError)
        return lake


def check_options(options: dict[str, Any], error: type[Exception] = ValueError) -> dict[str, Any]:
    """`data.options` of a frozenlake task set with the defaults filled in; `error` names the bad option."""
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise error(f"frozenlake takes options {sorted(DEFAULTS)}; unknown {sorted(unknown)}")
    merged = {**DEFAULTS, **options}
    if not isinstance(merged["size"], int) or isinstance(merged["size"], bool) or not 2 <= merged["size"] <= 12:
        raise error(f"frozenlake option size must be an int in [2, 12]; got {merged['size']!r}")
    if not isinstance(merged["is_slippery"], bool):
        raise error(f"frozenlake option is_slippery must be true or false; got {merged['is_slippery']!r}")
    if not isinstance(merged["p"], (int, float)) or isinstance(merged["p"], bool) or not 0 < merged["p"] <= 1:
        raise error(f"frozenlake option p must be a number in (0, 1]; got {merged['p']!r}")
    return merged


def lake_map(spec: LakeSpec) -> list[str]:
    """The map's rows (`S`, `F`, `H`, `G`), row 0 first: gymnasium's `generate_random_map(size, p, seed)`."""
    frozen_lake = require("gymnasium.envs.toy_text.frozen_lake", feature="frozenlake")
    return list(frozen_lake.generate_random_map(size=spec.size, p=spec.p, seed=spec.seed))


def render(rows: list[str], position: int) -> str:
    """The board as text: one line per row, `P` at `position` (row * size + column)."""
    size = len(rows[0])
    cells = [list(r) for r in rows]
    cells[position // size][position % size] = "P"
    return "\n".join("".join(r) for r in cells)


def parse_action(text: str) -> int | None:
    """The first move named in `text` (gymnasium's action number), or None."""
    m = _ACTION.search(text)
    if m is None:
        return None
    word = m.group(1).lower()
    return int(word) if word.isdigit() else ACTIONS.index(word)


def frozenlake_row(rng: random.Random, options: dict[str, Any]) -> dict[str, Any]:
    """One task row: the rules and the starting board as the prompt; the episode spec as `frozenlake`."""
    spec = LakeSpec(seed=rng.randrange(2 ** 31), **check_options(options))
    return {"prompt": f"{RULES}{render(lake_map(spec), 0)}{ASK}", "answer": "",
            METADATA_KEY: {"seed": spec.seed, "size": spec.size, "is_slippery": spec.is_slippery, "p": spec.p}}


def shortest_path(desc: list[str]) -> list[int]:
    """The actions (gymnasium's numbers) of a shortest path from S to G over non-hole cells of the map `desc`
    (rows, row 0 first), by BFS: the scripted expert of tools/make_demonstrations.py."""
    n = len(desc)
    start = next((r, c) for r in range(n) for c in range(n) if desc[r][c] == "S")
    previous: dict[tuple[int, int], tuple[tuple[int, int], int] | None] = {start: None}
    queue = collections.deque([start])
    while queue:
        r, c = queue.popleft()
        if desc[r][c] == "G":
            actions, cell = [], (r, c)
            while (step := previous[cell]) is not None:
                cell, action = step
                actions.append(action)
            return actions[::-1]
        for action, (dr, dc) in MOVES.items():
            nr, nc = r + dr, c + dc
            if 0 <= nr < n and 0 <= nc < n and desc[nr][nc] != "H" and (nr, nc) not in previous:
                previous[(nr, nc)] = ((r, c), action)
                queue.append((nr, nc))
    raise ValueError(f"the map {desc} has no path from S to G")


@register_environment("frozenlake")
class FrozenLakeEnvironment:
    """One FrozenLake-v1 episode of the task's lake (see the module docstring)."""

    owns_reward = True
    extra = "envs"  # gymnasium

    def __init__(self, task: TaskRecord, reward: Reward | None = None):
        gymnasium = require("gymnasium", feature="frozenlake")  # its registry; FrozenLake-v1 is pure Python (toy_text)

        self.spec = LakeSpec.of(task.metadata.get(METADATA_KEY))
        self.rows = lake_map(self.spec)
        self.env = gymnasium.make("FrozenLake-v1", desc=self.rows, is_slippery=self.spec.is_slippery)
        self.position, _ = self.env.reset(seed=self.spec.seed)
        self.actions: list[int | None] = []  # every step's parsed action (None: invalid), in order
        self.episode_info = dict(task.metadata[METADATA_KEY])  # the spec, seed included (sample metadata)

    def board(self) -> str:
        return render(self.rows, int(self.position))

    def state_key(self) -> str:
        """The state the model acts from: the board (the lake and where the player stands)."""
        return self.board()

    def step(self, model_text: str) -> EnvStep:
        action = parse_action(model_text)
        self.actions.append(action)
        if action is None:
            return EnvStep(f"\ninvalid move\n{self.board()}{ASK}", done=False, reward=0.0)
        self.position, reward, terminated, truncated, _ = self.env.step(action)
        done = bool(terminated or truncated)
        what = "goal!" if reward > 0 else ("hole" if terminated else ACTIONS[action])
        return EnvStep(f"\n{what}\n{self.board()}{ASK}", done=done, reward=float(reward))
