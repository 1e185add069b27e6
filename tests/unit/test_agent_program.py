"""The agent_program workflow's reading of a program's result (rft/workflows/agent_program.py): the last JSON result
line on stdout, a reward or an answer scored by the run's reward or a registered per-response reward it names, and
the failure class of everything else. Programs themselves run in tests/integration/test_agent_program_sandbox.py."""
from __future__ import annotations

import math

import pytest

from rft.rewards import build_reward
from rft.run.loading import run_config_from_dict
from rft.schema import TaskRecord
from rft.workflows import build_workflow
from rft.workflows.agent_program import _Outcome, _result_line


@pytest.fixture(scope="module")
def workflow(tmp_path_factory):
    cfg = run_config_from_dict({
        "model": {"path": str(tmp_path_factory.mktemp("model")), "chat_template": True},
        "explorer": {"workflow": "agent_program", "reward": "exact_match", "python_sandbox": "none",
                     "agent_command": ["python", "agent.py"], "agent_dir": str(tmp_path_factory.mktemp("agent"))}})
    return build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer))


def test_the_last_result_line_counts():
    output = 'log line\n{"reward": 0.5}\n{"progress": 3}\nnot json {\n{"answer": "7"}\n{"other": 1}\n'
    assert _result_line(output) == {"answer": "7"}
    assert _result_line('{"reward": 1}\n[1, 2]\n') == {"reward": 1}
    assert _result_line("no result\n") is None


@pytest.mark.parametrize(("line", "reward", "failure"), [
    ({"reward": 0.25}, 0.25, ""),
    ({"reward": None}, 0.0, "unscored"),
    ({"reward": "1"}, 0.0, "agent"),
    ({"reward": math.nan}, 0.0, "agent"),
    ({"reward": True}, 0.0, "agent"),
    ({"answer": "5"}, 1.0, ""),  # the run's reward: exact_match
    ({"answer": "4"}, 0.0, ""),
    ({"answer": 5}, 0.0, "agent"),
    ({"answer": "5", "verifier": "format"}, None, ""),  # a registered per-response reward
    ({"answer": "5", "verifier": "os:system"}, 0.0, "agent"),  # never an import path
    ({"answer": "5", "verifier": "weighted"}, 0.0, "agent"),  # a factory needs the run's config
    ({"answer": "5", "verifier": "no_such_reward"}, 0.0, "agent"),
    (None, 0.0, "agent"),
])
def test_the_result_gives_the_reward_or_the_failure(workflow, line, reward, failure):
    outcome = _Outcome([])
    workflow._score(outcome, line, TaskRecord("r", "t", 0, "What is 2+3?", "5"))
    assert outcome.failure == failure, outcome.error
    if reward is not None:
        assert outcome.reward == reward
    assert bool(outcome.error) == bool(failure)
