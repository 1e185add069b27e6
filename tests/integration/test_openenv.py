"""The `openenv` workflow against real OpenEnv servers (openenv 0.10, OpenEnv's own `create_app` and uvicorn, from
.venv-openenv: `make openenv`) serving the environments of examples/openenv/, with the tiny model in this process:

- FrozenLake through OpenEnv is rft's own FrozenLake: scripted moves (a shortest path, a hole, an invalid word) give
  the same observations, rewards and ends on both; the model's episodes replayed in rft's environment give the
  observation tokens and the reward of each sample, every sample's turns cover its response step by step with the
  native step rewards, and equal boards have equal state keys;
- failures are kept and classed, never scored 0: an error frame is `environment`, a step past the timeout is
  `timeout`, a reward of None at the end is `unscored`, a refused connection fails every episode at once, and the
  server killed between two turns fails the episodes still running as `environment` at once (no stall); the
  failed samples go through the wire schema with a nil reward.
"""
from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from rft.data.toy_tasks import generate_rows
from rft.engine import TransformersEngine
from rft.processes import die_with_parent, free_port, stop_group
from rft.rewards import build_reward
from rft.run.loading import run_config_from_dict
from rft.schema import ExperienceGroup, TaskRecord, decode_group, encode
from rft.workflows import build_workflow
from rft.workflows.frozenlake import FrozenLakeEnvironment, shortest_path
from rft.workflows.openenv_adapter import OpenEnvEnvironment, OpenEnvServer
from tests.episodes import replay, split_turns
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-openenv" / "bin" / "python"
SERVER = REPO / "examples" / "openenv" / "server.py"
START_S = 90  # the server imports openenv (FastAPI, gradio): 5 s on an idle 2-core machine


def server_command(env: str) -> str:
    return f"{PYTHON} {SERVER} {env} --port {{port}}"


def start_server(env: str) -> tuple[subprocess.Popen, str]:
    if not PYTHON.exists():
        raise AssertionError(f"OpenEnv's venv is not built at {PYTHON.parent.parent}: run `make openenv` "
                             "(requirements/openenv.txt)")
    port = free_port()
    process = subprocess.Popen([str(PYTHON), str(SERVER), env, "--port", str(port)], start_new_session=True,
                               preexec_fn=die_with_parent)
    return process, f"http://127.0.0.1:{port}"


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def servers():
    """The frozenlake and echo servers, started together."""
    started = {env: start_server(env) for env in ("frozenlake", "echo")}
    try:
        for env, (process, url) in started.items():
            wait_until(lambda url=url: healthy(url), timeout=START_S, what=f"the {env} server's /health",
                       alive=[process])
        yield {env: url for env, (_, url) in started.items()}
    finally:
        for process, _ in started.values():
            stop_group(process, timeout_s=5)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return TransformersEngine(tiny_model, seed=0, weights_version=3)


def workflow(tiny_model, openenv: dict, **explorer):
    cfg = run_config_from_dict({"model": {"path": str(tiny_model), "max_prompt_len": 256, "max_response_len": 250},
                                "explorer": {"engine": "transformers", "workflow": "openenv", "max_turns": 4,
                                             "n_samples": 3, "max_tokens": 3, "temperature": 1.0,
                                             "openenv": openenv, **explorer}})
    return build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer)), cfg


def lake_tasks(n: int, size: int = 3) -> list[TaskRecord]:
    rows = generate_rows("frozenlake", n, seed=11, options={"size": size})
    return [TaskRecord("r", f"lake{i}", 0, row["prompt"], "", {"frozenlake": row["frozenlake"]})
            for i, row in enumerate(rows)]


def test_frozenlake_through_openenv_is_rfts_frozenlake(servers, tiny_model):
    _, cfg = workflow(tiny_model, {"url": servers["frozenlake"], "reset_key": "frozenlake", "state_field": "board"})
    server = OpenEnvServer(cfg.explorer.openenv)
    words = ["left", "down", "right", "up"]
    ends, keys = [], {}  # keys: state key -> the native board
    for i, task in enumerate(lake_tasks(4, size=4)):
        path = [words[a] for a in shortest_path(FrozenLakeEnvironment(task).rows)]
        for moves in (path, ["no move here", *path[:-1], f"I go {path[-1]}!"], random.Random(i).choices(words, k=9)):
            native, remote = FrozenLakeEnvironment(task), OpenEnvEnvironment(server, cfg.explorer.openenv, task)
            try:
                assert remote.prompt == task.prompt
                for move in moves:
                    assert keys.setdefault(remote.state_key(), native.board()) == native.board()
                    expected = native.step(move)
                    assert remote.step(move) == expected
                    if expected.done:
                        ends.append(expected.reward)
                        break
            finally:
                remote.close()
    assert ends.count(1.0) == 8 and 0.0 in ends, "goals and holes both compared"
    assert len(set(keys.values())) == len(keys) > 20  # one key per board


def test_model_episodes_on_openenv_frozenlake(servers, tiny_model, engine):
    flow, cfg = workflow(tiny_model, {"url": servers["frozenlake"], "reset_key": "frozenlake", "state_field": "board"})
    tasks = lake_tasks(3)
    results = flow.explore(tasks, engine)
    boards: dict[str, str] = {}  # state key -> the native board the model acted from
    for task, result in zip(tasks, results, strict=True):
        assert result.error is None and len(result.samples) == 3 and result.policy_version == 3
        for s in result.samples:
            assert s.failure == "" and s.metadata["environment"] == task.metadata["frozenlake"]
            assert s.prompt_tokens.tolist() == engine.encode(task.prompt)  # the reset's text is the task's prompt
            runs = split_turns(s)
            assert [m for m, _ in runs] == [1, 0] * (len(runs) // 2) + [1] * (len(runs) % 2)
            model_turns = [engine.decode(ids) for m, ids in runs if m == 1]
            expected, observations = replay(FrozenLakeEnvironment(task), model_turns)
            assert [ids for m, ids in runs if m == 0] == [engine.encode(o, add_special_tokens=False)
                                                         for o in observations[:len(model_turns) - 1]]
            assert s.reward == expected == s.reward_components["return"]
            model = s.loss_mask == 1
            assert np.all(s.logprobs[~model] == 0) and np.all(s.logprobs[model] < 0)
            # turns: one per step, contiguous over the response, each a model run and the observation after it
            assert s.turns is not None and len(s.turns) == len(model_turns)
            assert [t.start for t in s.turns] == [0] + [t.end for t in s.turns[:-1]]
            assert s.turns[-1].end == len(s.response_tokens)
            native = FrozenLakeEnvironment(task)
            for turn, text in zip(s.turns, model_turns, strict=True):
                assert s.loss_mask[turn.start] == 1 and engine.decode(s.response_tokens[turn.start:turn.end][
                    s.loss_mask[turn.start:turn.end] == 1]) == text
                assert boards.setdefault(turn.state, native.board()) == native.board()
                assert turn.reward == (native.step(text).reward or 0.0)
        assert len({s.turns[0].state for s in result.samples if s.turns}) == 1  # one lake, one start
    assert len(set(boards.values())) == len(boards)  # one key per board


def test_failures_are_classed_kept_and_never_scored_zero(servers, tiny_model, engine):
    flow, _ = workflow(tiny_model, {"url": servers["echo"], "step_timeout_s": 0.5}, n_samples=2)
    plans = {"error": {"steps": 3, "fail_at": 2}, "hang": {"steps": 3, "hang_at": 2, "hang_s": 2},
             "unscored": {"steps": 2, "final_reward": None}, "silent": {"steps": 9, "step_reward": None},
             "scored": {"steps": 2, "step_reward": None, "final_reward": 0.5}, "badreset": {"steps": 0}}
    tasks = [TaskRecord("r", name, 0, "unused", "", {"openenv": plan}) for name, plan in plans.items()]
    began = time.monotonic()
    results = {r.task.task_id: r for r in flow.explore(tasks, engine)}
    assert time.monotonic() - began < 30
    expected = {"error": "environment", "hang": "timeout", "unscored": "unscored", "silent": "unscored",
                "scored": ""}
    badreset = results["badreset"].samples  # the reset answered an error frame: no prompt, no turn
    assert [s.failure for s in badreset] == ["environment"] * 2 and all(s.turns is None for s in badreset)
    assert "steps must be at least 1" in badreset[0].metadata["failure_detail"]
    for name, failure in expected.items():
        result = results[name]
        assert result.error is None and [s.failure for s in result.samples] == [failure] * 2, name
        for s in result.samples:
            assert s.prompt_tokens.tolist() == engine.encode("Say anything:")  # the reset's text, not the task's
            assert s.turns is not None and s.turns[-1].end == len(s.response_tokens)
            assert s.reward_components["turns"] == {"error": 2, "hang": 2, "unscored": 2, "silent": 4,
                                                    "scored": 2}[name]
    assert [s.reward for s in results["scored"].samples] == [0.5, 0.5]
    assert "failing at step 2" in results["error"].samples[0].metadata["failure_detail"]
    group = ExperienceGroup(run_id="r", task_id="error", group_id="r/error/e0", attempt=0, explorer_id="x",
                            policy_version=3, samples=results["error"].samples + results["scored"].samples)
    back = decode_group(*encode(group))
    assert [(s.failure, s.reward) for s in back.samples] == [("environment", 0.0)] * 2 + [("", 0.5)] * 2
    assert back.samples[0].turns == results["error"].samples[0].turns


def test_unreachable_or_killed_server_fails_episodes_at_once(tiny_model, engine):
    flow, _ = workflow(tiny_model, {"url": f"http://127.0.0.1:{free_port()}"}, n_samples=2)
    began = time.monotonic()
    [result] = flow.explore([TaskRecord("r", "down", 0, "the task's prompt", "", {})], engine)
    assert time.monotonic() - began < 10
    assert [s.failure for s in result.samples] == ["environment"] * 2
    assert all(len(s.response_tokens) == 0 and s.turns is None for s in result.samples)
    assert result.policy_version == 3 and "cannot open" in result.samples[0].metadata["failure_detail"]

    # the workflow starts its own server (openenv.command) and stops it; here it is killed after the first turn
    flow, _ = workflow(tiny_model, {"command": server_command("echo"), "start_timeout_s": START_S}, n_samples=2)
    server = flow.server.process
    assert server is not None and healthy(flow.server.http_url)

    class KillsTheServer:
        """The engine, with the server killed before the model's second turn."""
        calls = 0

        def __getattr__(self, name):
            return getattr(engine, name)

        def generate(self, prompts, sampling):
            KillsTheServer.calls += 1
            if KillsTheServer.calls == 2:
                stop_group(server, timeout_s=5)
            return engine.generate(prompts, sampling)

    began = time.monotonic()
    [result] = flow.explore([TaskRecord("r", "killed", 0, "", "", {"openenv": {"steps": 5}})], KillsTheServer())
    assert time.monotonic() - began < 10
    assert [s.failure for s in result.samples] == ["environment"] * 2
    for s in result.samples:
        assert [t.reward for t in s.turns] == [0.0, 0.0] and s.reward_components["turns"] == 2
        assert s.turns[-1].end == len(s.response_tokens)
    flow.server.stop()
    assert server.poll() is not None


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
