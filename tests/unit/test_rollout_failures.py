"""multi_turn's failed rollouts and turns on the tiny model, with scripted environments (rft's own Environment
protocol): a `RolloutFailure` when an environment is built or stepped keeps the sample with its class and no reward
(the other samples of the group are scored as usual), a reward of None at the episode's end (or no reward at all)
is `unscored`, every sample records its steps (contiguous token spans over the response, the state acted from,
the step's reward), an environment's own prompt replaces the task's, and every environment is closed. The
`openenv` workflow's keys and its frame parsing without a server (the server: tests/integration/test_openenv.py)."""
from __future__ import annotations

import hashlib
import math
from collections import defaultdict

import pytest

from rft.config import ConfigError
from rft.engine import TransformersEngine
from rft.rewards import build_reward
from rft.run.loading import run_config_from_dict
from rft.schema import TaskRecord
from rft.workflows import build_workflow
from rft.workflows.frozenlake import FrozenLakeEnvironment
from rft.workflows.multi_turn import EnvStep, RolloutFailure
from rft.workflows.openenv_adapter import observation_text, state_key, step_reward
from tests.episodes import split_turns

SAMPLES = 3


@pytest.fixture(scope="module")
def engine(tiny_model):
    return TransformersEngine(tiny_model, seed=0, weights_version=5)


def explore(tiny_model, engine, environment: str, tasks, **explorer):
    cfg = run_config_from_dict({"model": {"path": str(tiny_model), "max_prompt_len": 256, "max_response_len": 250},
                                "explorer": {"engine": "transformers", "workflow": "multi_turn",
                                             "environment": environment, "max_turns": 4, "n_samples": SAMPLES,
                                             "max_tokens": 4, "temperature": 1.0, **explorer}})
    return build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer)).explore(tasks, engine)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Scripted:
    """Sample k of a task follows `task.metadata["plan"][k]`: "build" fails when built, "step<N>" fails at step N
    (class `task.metadata["failure"]`), "none" ends at step 2 with reward None, "silent" never rewards, "late" has
    reward None at step 1 and 0.5 at the end (step 2), anything else rewards 0.25 per step over 3 steps. Its prompt
    is "scripted:" when the task asks (`own_prompt`). Every instance is recorded, and whether it was closed."""

    owns_reward = True
    made: dict[str, list[Scripted]] = defaultdict(list)

    def __init__(self, task: TaskRecord, reward=None):
        self.plan = task.metadata["plan"][len(Scripted.made[task.task_id])]
        self.failure = task.metadata.get("failure", "environment")
        Scripted.made[task.task_id].append(self)
        self.steps, self.closed = 0, False
        if task.metadata.get("own_prompt"):
            self.prompt = "scripted:"
        if self.plan == "build":
            raise RolloutFailure(self.failure, "cannot reach the server")

    def step(self, model_text: str) -> EnvStep:
        self.steps += 1
        if self.plan == f"step{self.steps}":
            raise RolloutFailure(self.failure, f"failed at step {self.steps}")
        if self.plan == "none":
            return EnvStep(f"\n{self.steps}\n", done=self.steps == 2, reward=None)
        if self.plan == "silent":
            return EnvStep(f"\n{self.steps}\n", done=False, reward=None)
        if self.plan == "late":
            return EnvStep(f"\n{self.steps}\n", done=self.steps == 2, reward=None if self.steps == 1 else 0.5)
        return EnvStep(f"\n{self.steps}\n", done=self.steps == 3, reward=0.25)

    def close(self) -> None:
        self.closed = True


def scripted_task(name: str, plan: list[str], **metadata) -> TaskRecord:
    return TaskRecord("r", name, 0, ":7", "", {"plan": plan, **metadata})


def test_turns_are_the_steps_over_the_response(tiny_model, engine):
    [result] = explore(tiny_model, engine, "tests.episodes:CountingEnvironment", [TaskRecord("r", "t", 0, ":5", "")],
                       max_turns=3, max_tokens=5)
    for s in result.samples:
        texts = [engine.decode(ids) for m, ids in split_turns(s) if m == 1]
        assert s.turns is not None and len(s.turns) == len(texts) == 3
        assert [t.start for t in s.turns] == [0] + [t.end for t in s.turns[:-1]]
        assert s.turns[-1].end == len(s.response_tokens)
        assert all(s.loss_mask[t.start] == 1 for t in s.turns)
        assert [t.reward for t in s.turns] == [len(t) % 3 / 10 for t in texts]
        assert [t.state for t in s.turns] == [sha(":5"), sha("\nstep 1\n"), sha("\nstep 2\n")]


def test_frozenlake_turns_are_keyed_by_the_board(tiny_model, engine):
    from rft.data.toy_tasks import generate_rows
    row = generate_rows("frozenlake", 1, seed=2, options={"size": 3})[0]
    task = TaskRecord("r", "lake", 0, row["prompt"], "", {"frozenlake": row["frozenlake"]})
    [result] = explore(tiny_model, engine, "frozenlake", [task], max_tokens=3)
    for s in result.samples:
        native = FrozenLakeEnvironment(task)
        for turn, (_, ids) in zip(s.turns, [r for r in split_turns(s) if r[0] == 1], strict=True):
            assert turn.state == native.board()
            native.step(engine.decode(ids))


def test_a_failed_rollout_is_kept_with_its_class_and_the_others_are_scored(tiny_model, engine):
    Scripted.made.clear()
    tasks = [scripted_task("mixed", ["ok", "step2", "build"]),
             scripted_task("timeouts", ["step1", "ok", "ok"], failure="timeout"),
             scripted_task("down", ["build"] * SAMPLES, own_prompt=True)]
    results = {r.task.task_id: r for r in explore(tiny_model, engine, "tests.unit.test_rollout_failures:Scripted",
                                                  tasks)}
    ok, failed, unbuilt = results["mixed"].samples
    assert (ok.failure, ok.reward, len(ok.turns)) == ("", 0.75, 3) and ok.reward_components["return"] == 0.75
    assert (failed.failure, failed.reward) == ("environment", 0.0)
    assert failed.metadata["failure_detail"] == "failed at step 2" and "failure_detail" not in ok.metadata
    assert [t.reward for t in failed.turns] == [0.25, 0.0] and failed.turns[-1].end == len(failed.response_tokens)
    assert failed.reward_components["turns"] == 2
    assert unbuilt.failure == "environment" and len(unbuilt.response_tokens) == 0 and unbuilt.turns is None
    assert unbuilt.prompt_tokens.tolist() == engine.encode(":7")
    assert [s.failure for s in results["timeouts"].samples] == ["timeout", "", ""]
    assert [s.reward for s in results["timeouts"].samples][1:] == [0.75, 0.75]
    down = results["down"]
    assert down.error is None and [s.failure for s in down.samples] == ["environment"] * SAMPLES
    assert down.policy_version == 5  # no token generated: the engine's version
    assert all(e.closed for made in Scripted.made.values() for e in made if e.plan != "build")


def test_a_reward_of_none_at_the_end_is_unscored_never_zero(tiny_model, engine):
    Scripted.made.clear()
    tasks = [scripted_task("end", ["none", "ok", "late"]), scripted_task("silent", ["silent"] * SAMPLES)]
    results = explore(tiny_model, engine, "tests.unit.test_rollout_failures:Scripted", tasks)
    assert [(s.failure, s.reward) for s in results[0].samples] == [("unscored", 0.0), ("", 0.75), ("", 0.5)]
    assert "step 2 without a reward" in results[0].samples[0].metadata["failure_detail"]
    assert [s.failure for s in results[1].samples] == ["unscored"] * SAMPLES  # truncated at max_turns, never rewarded
    assert all(len(s.turns) == 4 for s in results[1].samples)


def test_an_environments_prompt_replaces_the_tasks(tiny_model, engine):
    Scripted.made.clear()
    [result] = explore(tiny_model, engine, "tests.unit.test_rollout_failures:Scripted",
                       [scripted_task("own", ["ok"] * SAMPLES, own_prompt=True)])
    assert all(s.prompt_tokens.tolist() == engine.encode("scripted:") for s in result.samples)
    assert all(s.turns[0].state == sha("scripted:") for s in result.samples)


class FailsFirst:
    """Does not own the reward: the first episode of a task fails at its first step, the others go on."""

    made: dict[str, int] = defaultdict(int)

    def __init__(self, task: TaskRecord, reward=None):
        self.first = FailsFirst.made[task.task_id] == 0
        FailsFirst.made[task.task_id] += 1

    def step(self, model_text: str) -> EnvStep:
        if self.first:
            raise RolloutFailure("verifier", "the checker crashed")
        return EnvStep("\nagain\n", done=False)


def test_the_run_s_reward_scores_the_episodes_that_did_not_fail(tiny_model, engine):
    task = TaskRecord("r", "t", 0, ":1", "x")
    [result] = explore(tiny_model, engine, "tests.unit.test_rollout_failures:FailsFirst", [task], max_turns=2,
                       reward="char_accuracy")
    failed, *scored = result.samples
    assert failed.failure == "verifier" and [s.failure for s in scored] == ["", ""]
    texts = [engine.decode([t for t, m in zip(s.response_tokens, s.loss_mask, strict=True) if m][-4:]) for s in scored]
    reward = build_reward(run_config_from_dict({"model": {"path": "m"},
                                                "explorer": {"reward": "char_accuracy"}}).explorer)
    assert [s.reward for s in scored] == [r.score for r in reward.score(texts, task)]


@pytest.mark.parametrize("openenv,message", [
    ({"url": "http://h:1", "command": "x {port}"}, "explorer.openenv.url: set openenv.url"),
    ({"url": "h:1"}, "explorer.openenv.url: must start with http://"),
    ({"command": "serve --port 80"}, "explorer.openenv.command: must contain {port}"),
    ({"step_timeout_s": 0}, "explorer.openenv.step_timeout_s"),
])
def test_openenv_keys_are_checked(openenv, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("{", r"\{")):
        run_config_from_dict({"model": {"path": "m"}, "explorer": {"workflow": "openenv", "openenv": openenv}})


def test_openenv_workflow_needs_a_server():
    with pytest.raises(ConfigError, match="explorer.openenv: the openenv workflow needs openenv.url"):
        run_config_from_dict({"model": {"path": "m"}, "explorer": {"workflow": "openenv"}})


def test_openenv_frames_are_checked_where_they_enter():
    assert observation_text({"observation": {"text": "hi"}}, "text") == "hi"
    assert step_reward({"reward": 1}) == 1.0 and step_reward({"reward": None}) is None
    for data, field in [({"observation": "hi"}, "text"), ({"observation": {"text": 3}}, "text"), (["x"], "text"),
                        ({"observation": {"words": "hi"}}, "text")]:
        with pytest.raises(RolloutFailure) as failure:
            observation_text(data, field)
        assert failure.value.failure == "environment"
    for reward in (math.nan, math.inf, True, "1", [1]):
        with pytest.raises(RolloutFailure, match="not a finite number"):
            step_reward({"reward": reward})
    assert state_key({"board": "P", "text": "a"}, "board") == state_key({"board": "P", "text": "b"}, "board")
    assert state_key({"board": "P", "text": "a"}, "") != state_key({"board": "P", "text": "b"}, "")
    assert state_key({"a": 1, "b": 2}, "") == state_key({"b": 2, "a": 1}, "")
    with pytest.raises(ValueError, match="not one of"):
        RolloutFailure("oops", "an unknown class")
