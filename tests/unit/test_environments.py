"""The multi-turn environments that own their reward: frozenlake (gymnasium FrozenLake-v1) and textarena
(GuessTheNumber): action parsing, the board as text against gymnasium's own map, seed determinism, rewards from
scripted play (a shortest path found by BFS on gymnasium's map, a binary search), invalid actions, bad task
metadata, the task source's options, and the multi_turn workflow on the tiny model with the reward replayed."""
from __future__ import annotations

import dataclasses
import random

import gymnasium
import pytest

from rft.config import ConfigError
from rft.data.tasks import load_rows, rows_to_tasks
from rft.data.toy_tasks import generate_rows
from rft.data.toy_tasks import main as toy_main
from rft.engine import TransformersEngine
from rft.rewards import build_reward
from rft.run.loading import run_config_from_dict
from rft.schema import TaskRecord
from rft.workflows import build_workflow
from rft.workflows.frozenlake import FrozenLakeEnvironment, parse_action, shortest_path
from rft.workflows.textarena_game import TextArenaEnvironment
from tests.episodes import replay, split_turns


def task_of(row: dict, i: int = 0) -> TaskRecord:
    return TaskRecord("r", f"t{i}", 0, row["prompt"], row["answer"],
                      {k: v for k, v in row.items() if k not in ("prompt", "answer")})


def gym_desc(spec: dict) -> list[str]:
    """The map gymnasium itself builds for the spec (an env made and reset independently of rft)."""
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map
    env = gymnasium.make("FrozenLake-v1", desc=generate_random_map(size=spec["size"], p=spec["p"], seed=spec["seed"]),
                         is_slippery=spec["is_slippery"])
    env.reset(seed=spec["seed"])
    return ["".join(c.decode() for c in row) for row in env.unwrapped.desc]




@pytest.mark.parametrize("text,action", [("left", 0), ("I go DOWN now", 1), ("right, not left", 2), ("up!", 3),
                                         ("3", 3), ("move 0", 0), ("upper", None), ("7", None), ("", None),
                                         ("leftover 12", None)])
def test_frozenlake_parses_the_first_move(text, action):
    assert parse_action(text) == action


def test_frozenlake_board_is_gymnasiums_map_and_the_seed_fixes_it():
    rows = generate_rows("frozenlake", 6, seed=3, options={"size": 5})
    assert rows == generate_rows("frozenlake", 6, seed=3, options={"size": 5})
    assert len({r["frozenlake"]["seed"] for r in rows}) == 6
    maps = set()
    for row in rows:
        desc = gym_desc(row["frozenlake"])
        board = row["prompt"].split("\n")[1:6]
        assert board == ["P" + desc[0][1:]] + desc[1:]  # the player stands on S
        assert row["prompt"].endswith("Reply with one word: left, down, right or up.")
        maps.add(tuple(desc))
    assert len(maps) > 1


def test_frozenlake_shortest_path_earns_1_and_a_hole_0():
    for i, row in enumerate(generate_rows("frozenlake", 5, seed=0)):
        desc = gym_desc(row["frozenlake"])
        env = FrozenLakeEnvironment(task_of(row, i))
        path = shortest_path(desc)
        steps = [env.step(["left", "down", "right", "up"][a]) for a in path]
        assert [s.done for s in steps] == [False] * (len(path) - 1) + [True]
        assert [s.reward for s in steps] == [0.0] * (len(path) - 1) + [1.0]
        assert "goal!" in steps[-1].observation
    # row 0's map (seed 0): PFHF / FFFH / FFFF / HHFG: right, right walks into the hole at (0, 2)
    env = FrozenLakeEnvironment(task_of(generate_rows("frozenlake", 1, seed=0)[0]))
    assert env.rows[0][2] == "H"
    first, second = env.step("right"), env.step("right")
    assert (first.done, first.reward) == (False, 0.0) and (second.done, second.reward) == (True, 0.0)


def test_frozenlake_invalid_action_is_a_step_that_does_not_move():
    env = FrozenLakeEnvironment(task_of(generate_rows("frozenlake", 1, seed=0)[0]))
    step = env.step("jump")
    assert not step.done and step.reward == 0.0 and step.observation.startswith("\ninvalid move")
    assert step.observation.split("\n")[2:6] == ["PFHF", "FFFH", "FFFF", "HHFG"]
    assert env.actions == [None] and env.position == 0
    assert env.step("down").observation.split("\n")[2:4] == ["SFHF", "PFFH"]


def test_slippery_episodes_of_one_seed_replay_exactly():
    row = generate_rows("frozenlake", 1, seed=4, options={"is_slippery": True, "size": 8})[0]
    actions = [random.Random(9).choice(["left", "down", "right", "up"]) for _ in range(30)]
    trajectories = []
    for _ in range(2):
        env, seen = FrozenLakeEnvironment(task_of(row)), []
        for a in actions:
            step = env.step(a)
            seen.append((step.observation, step.reward))
            if step.done:
                break
        trajectories.append(seen)
    assert trajectories[0] == trajectories[1]
    # gymnasium's own env with the same seed and actions lands where rft's did
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map
    spec = row["frozenlake"]
    ref = gymnasium.make("FrozenLake-v1", desc=generate_random_map(size=8, p=0.8, seed=spec["seed"]), is_slippery=True)
    ref.reset(seed=spec["seed"])
    env = FrozenLakeEnvironment(task_of(row))
    for a in actions[:len(trajectories[0])]:
        env.step(a)
        position = ref.step(["left", "down", "right", "up"].index(a))[0]
    assert env.position == position


def guess(env: TextArenaEnvironment) -> tuple[list[int], float]:
    """Binary search on 1..20 through the game's hints: the guesses and the final reward."""
    low, high, guesses = 1, 20, []
    while True:
        g = (low + high) // 2
        guesses.append(g)
        step = env.step(f"My guess: [{g}]")
        if step.done:
            return guesses, step.reward
        low, high = (low, g - 1) if "lower" in step.observation else (g + 1, high)


def test_textarena_guess_the_number_is_seeded_and_pays_1_for_the_number():
    rows = generate_rows("textarena", 4, seed=1)
    assert rows == generate_rows("textarena", 4, seed=1)
    assert rows[0]["prompt"].startswith("You are Player 0. You are playing Guess The Number.")
    random.seed(123)
    before = random.getstate()
    for i, row in enumerate(rows):
        first, second = guess(TextArenaEnvironment(task_of(row, i))), guess(TextArenaEnvironment(task_of(row, i)))
        assert first == second and first[1] == 1.0 and len(first[0]) <= 5
    assert random.getstate() == before  # the games never touched the process's random state
    numbers = {guess(TextArenaEnvironment(task_of(row)))[0][-1] for row in generate_rows("textarena", 8, seed=2)}
    assert len(numbers) > 1


def test_textarena_second_invalid_move_ends_the_game_with_the_games_reward():
    env = TextArenaEnvironment(task_of(generate_rows("textarena", 1, seed=1)[0]))
    first = env.step("no brackets")
    assert not first.done and "invalid move" in first.observation
    second = env.step("still none")
    assert second.done and second.reward == 0.0  # no guess yet: completion 0


@pytest.mark.parametrize("env_cls,metadata", [(FrozenLakeEnvironment, {}),
                                              (FrozenLakeEnvironment, {"frozenlake": {"seed": "1"}}),
                                              (FrozenLakeEnvironment, {"frozenlake": {"seed": 1, "size": 99}}),
                                              (TextArenaEnvironment, {"textarena": {"seed": 1}}),
                                              (TextArenaEnvironment, {"textarena": {"env_id": "NoSuchGame-v0",
                                                                                    "seed": 1}})])
def test_bad_environment_metadata_makes_the_group_an_error(tiny_model, engine, env_cls, metadata):
    name = "frozenlake" if env_cls is FrozenLakeEnvironment else "textarena"
    cfg = env_cfg(tiny_model, name)
    workflow = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer))
    result = workflow.explore([TaskRecord("r", "bad", 0, "x", "", metadata)], engine)[0]
    assert result.error.startswith("task cannot be explored: ") and not result.samples


@pytest.mark.parametrize("data,message", [
    ({"path": "frozenlake", "options": {"size": 1}}, "data.options: frozenlake option size must be an int in"),
    ({"path": "frozenlake", "options": {"slippery": True}}, r"data.options: frozenlake takes options .*'slippery'"),
    ({"path": "textarena", "options": {"env_id": "NoSuchGame-v0"}}, "data.options: textarena cannot make"),
    ({"path": "copy_char", "options": {"size": 4}}, "data.options: this toy task takes no options")])
def test_task_set_options_are_checked_by_key(tiny_model, data, message):
    with pytest.raises(ConfigError, match=message):
        run_config_from_dict({"model": {"path": str(tiny_model)}, "data": {"format": "generated", **data}})


@pytest.fixture(scope="module")
def engine(tiny_model):
    return TransformersEngine(tiny_model, seed=0, weights_version=2)


def env_cfg(tiny_model, environment: str, **explorer):
    return run_config_from_dict({"model": {"path": str(tiny_model), "max_prompt_len": 256, "max_response_len": 250},
                                 "explorer": {"engine": "transformers", "workflow": "multi_turn",
                                              "environment": environment, "max_turns": 4, "n_samples": 3,
                                              "max_tokens": 4, "temperature": 1.0, **explorer}})


@pytest.mark.parametrize("environment", ["frozenlake", "textarena"])
def test_multi_turn_reward_is_the_replayed_return(tiny_model, engine, environment):
    cfg = env_cfg(tiny_model, environment, max_tokens=3 if environment == "frozenlake" else 5)
    env_cls = FrozenLakeEnvironment if environment == "frozenlake" else TextArenaEnvironment
    tasks = [task_of(r, i) for i, r in enumerate(generate_rows(environment, 3, seed=0))]
    if environment == "textarena":  # the game's own prompt is too long for the tiny model: a short one
        tasks = [dataclasses.replace(t, prompt="Guess 1-20 as [n]:") for t in tasks]
    results = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer)).explore(tasks, engine)
    for task, result in zip(tasks, results, strict=True):
        assert result.error is None and len(result.samples) == 3 and result.policy_version == 2
        assert all(s.metadata["environment"] == task.metadata[environment] for s in result.samples)
        for s in result.samples:
            turns = split_turns(s)
            assert [m for m, _ in turns] == [1, 0] * (len(turns) // 2) + [1] * (len(turns) % 2)
            model_turns = [engine.decode(ids) for m, ids in turns if m == 1]
            expected, observations = replay(env_cls(task), model_turns)
            assert [ids for m, ids in turns if m == 0] == [engine.encode(o, add_special_tokens=False)
                                                          for o in observations[:len(model_turns) - 1]]
            assert s.reward == expected == s.reward_components["return"]
            assert s.reward_components["turns"] == len(model_turns) <= 4
            check_turns(s, env_cls(task), model_turns, environment)
        if environment == "textarena":  # no state_key: the digest of what the model saw, the prompt first
            assert len({s.turns[0].state for s in result.samples}) == 1


def check_turns(s, environment, model_turns: list[str], name: str) -> None:
    """A sample's `turns` (gigpo's input) against its loss mask and a replay of its episode: one per model turn,
    from its first token to the next turn's, the state the model acted from, the step's reward."""
    starts = [i for i in range(len(s.loss_mask)) if s.loss_mask[i] == 1 and (i == 0 or s.loss_mask[i - 1] == 0)]
    assert [t.start for t in s.turns] == starts
    assert [t.end for t in s.turns] == starts[1:] + [len(s.response_tokens)]
    states, rewards = [], []
    for text in model_turns:
        states.append(environment.state_key() if name == "frozenlake" else None)
        step = environment.step(text)
        rewards.append(step.reward or 0.0)
        if step.done:
            break
    assert [t.reward for t in s.turns] == pytest.approx(rewards)
    if name == "frozenlake":
        assert [t.state for t in s.turns] == states and states[0].startswith("P")  # the board, the player at start


@pytest.mark.parametrize("environment,failure", [("tests.episodes:BrokenEnvironment", "environment"),
                                                 ("tests.episodes:SlowEnvironment", "timeout"),
                                                 ("tests.episodes:UnreachableEnvironment", "environment")])
def test_an_environment_that_fails_marks_its_episodes_and_the_group_is_delivered(tiny_model, engine, environment,
                                                                                 failure):
    from rft.schema import ExperienceGroup, decode_group, encode
    cfg = env_cfg(tiny_model, environment, max_turns=3, max_tokens=3)
    tasks = [TaskRecord("r", "t", 0, ":5", "")]
    result = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer)).explore(tasks, engine)[0]
    assert result.error is None and [s.failure for s in result.samples] == [failure] * 3
    if environment.endswith("UnreachableEnvironment"):
        assert all(len(s.response_tokens) == 0 and not s.turns for s in result.samples)
    else:  # the first model turn was stepped, the second one's step failed
        assert all(len(s.turns) == 2 for s in result.samples)
    group = ExperienceGroup(run_id="r", task_id="t", group_id="g", attempt=0, explorer_id="e",
                            policy_version=result.policy_version, samples=result.samples)
    assert decode_group(encode(group)[0]).scored_samples == []  # every reward nil on the wire: the trainer drops it


@pytest.mark.parametrize("max_turns", [2, 5])
def test_episode_reward_is_the_sum_of_step_rewards_the_last_turn_included(tiny_model, engine, max_turns):
    cfg = env_cfg(tiny_model, "tests.episodes:CountingEnvironment", max_turns=max_turns, max_tokens=5)
    tasks = [TaskRecord("r", "t", 0, ":5", "")]
    samples = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer)).explore(tasks, engine)[0].samples
    assert len(samples) == 3
    for s in samples:
        texts = [engine.decode(ids) for m, ids in split_turns(s) if m == 1]
        assert len(texts) == min(max_turns, 3)  # the environment ends the episode after its third step
        expected = sum(len(t) % 3 / 10 for t in texts)  # every model turn was stepped, the last one too
        assert s.reward == pytest.approx(expected) and s.reward_components["steps"] == len(texts)
    assert any(s.reward > 0 for s in samples), "the sums above are checked on rewards that are not all 0"


def test_environment_tasks_as_a_jsonl_file_are_the_generated_ones(tmp_path):
    out = tmp_path / "lakes.jsonl"
    assert toy_main(["frozenlake", str(out), "--count", "3", "--seed", "5", "--options", '{"size": 5}']) == 0
    cfg = run_config_from_dict({"model": {"path": "m"}, "data": {"format": "jsonl", "path": str(out)}})
    tasks = rows_to_tasks(load_rows(cfg.data), cfg.data, run_id="r")
    rows = generate_rows("frozenlake", 3, seed=5, options={"size": 5})
    assert [(t.prompt, t.metadata) for t in tasks] == [(r["prompt"], {"frozenlake": r["frozenlake"]}) for r in rows]
    assert FrozenLakeEnvironment(tasks[0]).board() == rows[0]["prompt"].split("\n", 1)[1].split("\nWhich")[0]
