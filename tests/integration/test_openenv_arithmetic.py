"""configs/smollm2-arithmetic-openenv.yaml (the quickstart's task on an OpenEnv server: arithmetic_env.py of
examples/openenv, from .venv-openenv, started by the config's own command) against rft's own path,
configs/smollm2-arithmetic.yaml:

- the server's reset text is the task's prompt (the config's prompt_template) and every reply's reward through the
  server is rft's `reasoning_gym` reward of it: right, wrong, partial credit, no number, thousands separators,
  reasoning before the answer;
- the held-out set is the same tasks and goes through the environment (`rft eval`'s `load_eval_sets` builds the
  openenv workflow): on the tiny model, greedy, every episode is one step whose prompt tokens, reply tokens and
  reward are those of rft's single_turn path on the same task.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rft.engine import TransformersEngine
from rft.evaluation.main import load_eval_sets
from rft.rewards import build_reward
from rft.run.loading import load_run_config
from rft.workflows.openenv_adapter import OpenEnv, OpenEnvEnvironment

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def paths(tiny_model):
    """(the OpenEnv config's eval set, rft's own config's eval set, the OpenEnv explorer section, rft's reward), on
    the tiny model (plain-text prompts); the server is started by the OpenEnv config's command (its paths made
    absolute) when the eval set's workflow is built."""
    if not (REPO / ".venv-openenv" / "bin" / "python").exists():
        raise AssertionError("OpenEnv's venv is not built: run `make openenv` (requirements/openenv.txt)")
    overrides = [f"model.path={tiny_model}", "explorer.engine=transformers", "model.max_prompt_len=256",
                 "model.chat_template=false"]  # the tiny tokenizer has none; the path is the same either way
    own = load_run_config(REPO / "configs" / "smollm2-arithmetic.yaml", overrides)
    cfg = load_run_config(REPO / "configs" / "smollm2-arithmetic-openenv.yaml", overrides)
    command = cfg.explorer.openenv.command.replace(".venv-openenv/", f"{REPO}/.venv-openenv/", 1).replace(
        "examples/", f"{REPO}/examples/", 1)
    explorer = dataclasses.replace(cfg.explorer, openenv=dataclasses.replace(cfg.explorer.openenv, command=command,
                                                                             start_timeout_s=90))
    [remote] = load_eval_sets(cfg.eval, explorer, cfg.model, run_id="r", seed=0)
    try:
        [native] = load_eval_sets(own.eval, own.explorer, own.model, run_id="r", seed=0)
        yield remote, native, explorer, build_reward(own.explorer)
    finally:
        assert isinstance(remote.workflow, OpenEnv)
        remote.workflow.server.stop()


def test_replies_score_as_rfts_reasoning_gym_reward(paths):
    remote, native, explorer, reward = paths
    assert [t.task_id for t in remote.tasks] == [t.task_id for t in native.tasks]  # the same held-out tasks
    assert isinstance(remote.workflow, OpenEnv)
    seen = set()
    for task in native.tasks[:6]:
        a = task.answer
        replies = [a, f"The answer is {a}.", f"{a}0", f"1{a}", "I do not know", f"{int(a) + 1}", f"{a} + 1 = 9",
                   f"{int(a) * 1000:,}", f"-{a}".replace("--", ""), f"{a}.0", ""]
        for reply in replies:
            expected = reward.score([reply], task)[0].score
            environment = OpenEnvEnvironment(remote.workflow.server, explorer.openenv, task)
            try:
                assert environment.prompt == task.prompt
                step = environment.step(reply)
            finally:
                environment.close()
            assert (step.reward, step.done, step.observation) == (expected, True, ""), (task.prompt, reply)
            seen.add(expected)
    assert {0.0, 1.0} < seen and any(0 < s < 1 for s in seen)  # right, wrong and partial credit compared


def test_held_out_episodes_are_rfts_own(paths, tiny_model):
    remote, native, _, reward = paths
    engine = TransformersEngine(tiny_model, seed=0, weights_version=2)
    tasks = remote.tasks[:8]
    for theirs, ours in zip(remote.workflow.explore(tasks, engine), native.workflow.explore(tasks, engine),
                            strict=True):
        assert theirs.error is None and ours.error is None and len(theirs.samples) == len(ours.samples) == 1
        [s], [o] = theirs.samples, ours.samples
        assert s.failure == "" and s.reward_components["steps"] == 1 and s.turns is not None and len(s.turns) == 1
        assert s.prompt_tokens.tolist() == o.prompt_tokens.tolist()
        assert s.response_tokens.tolist() == o.response_tokens.tolist()  # greedy: the same reply
        assert s.reward == o.reward == reward.score([engine.decode(o.response_tokens.tolist())], theirs.task)[0].score
        assert s.metadata["environment"] == theirs.task.metadata["reasoning_gym"]
