"""The verifiers workflow against verifiers' own env server, run from its own venv as a separate process (`make
hub-envs`), on the tests' offline environment (tests/support/verifiers_env/rft_vf_arith.py: two-turn arithmetic, a
harness running an `openai`-client program in the subprocess runtime, a rubric `correct` 0.75 + `brief` 0.25), with
the real transformers engine on the tiny chat model. One test, one server (each server start imports verifiers:
seconds), in phases:
1. the taskset's tasks come from verifiers in its venv (`data.format: verifiers`);
2. a batch of two tasks, two episodes each: the clean task's samples hold exactly the tokens and log-probs the
   engine generated (the endpoint's records: prompt = the first call's prompt, response = completion, the
   environment's turn masked, completion), and the weighted reward of the trace's named rewards; the task whose
   verifier crashes keeps its samples as `verifier` failures, not zeros;
3. a second workflow on the same server (`explorer.verifiers.address`) with a deadline shorter than an episode:
   `timeout` failures, the runs cancelled;
4. the server killed while its episodes wait on the model: `environment` failures within the health check, not a
   stall.
"""
from __future__ import annotations

import dataclasses
import math
import threading
import time
from pathlib import Path

import pytest

from rft.config import build_section
from rft.data.config import DataConfig
from rft.data.tasks import load_rows, rows_to_tasks
from rft.engine import TransformersEngine
from rft.explorer.config import ExplorerConfig
from rft.models.config import ModelConfig
from rft.workflows.verifiers import Verifiers
from tests.tool_agent_support import make_chat_model

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".cache" / "verifiers" / "bin" / "python"
ENV_DIR = REPO / "tests" / "support" / "verifiers_env"
ENV = {"taskset": {"id": "rft_vf_arith", "size": 2}, "agent": {"runtime": {"type": "subprocess"}}}


def explorer(**verifiers) -> ExplorerConfig:
    # a health check every second, answered within 5 s: a server busy on a loaded machine (the suite's 3 workers on 2
    # cores) is not taken for dead (0.5 s was, once), and a killed one is found at the next look (its process gone)
    options = {"env": ENV, "python": str(PYTHON), "pythonpath": [str(ENV_DIR)], "health_every_s": 1.0,
               "health_timeout_s": 5.0, "episode_timeout_s": 60, **verifiers}
    return build_section(ExplorerConfig, {"workflow": "verifiers", "n_samples": 2, "max_tokens": 6,
                                          "temperature": 1.0, "verifiers": options}, source="test", prefix="explorer")


def recording(workflow: Verifiers) -> list:
    """Every episode's recorded calls, as the workflow closes them."""
    seen: list = []
    assert workflow.endpoint is not None
    close = workflow.endpoint.close_episode

    def keep(episode):
        calls = close(episode)
        seen.append(calls)
        return calls

    workflow.endpoint.close_episode = keep  # type: ignore[method-assign]
    return seen


def test_a_verifiers_environment_runs_through_its_own_server(tmp_path):
    if not PYTHON.exists():
        raise AssertionError(f"verifiers' venv is not installed at {PYTHON}: run `make hub-envs` "
                             "(requirements/verifiers.txt)")
    model = build_section(ModelConfig, {"path": str(make_chat_model(tmp_path / "chat")), "chat_template": True,
                                        "max_prompt_len": 400, "max_response_len": 64}, source="test", prefix="model")
    engine = TransformersEngine(model.path, seed=0, chat_template=True, weights_version=4)
    workflow = Verifiers(explorer(), model, reward=None)  # type: ignore[arg-type]  (the environment scores)
    started = time.monotonic()
    starting = threading.Thread(target=workflow.explore, args=([], engine))  # starts the server and the endpoint
    starting.start()
    try:
        data = DataConfig(format="verifiers", path="rft_vf_arith", generated_tasks=2,
                          options={"taskset": {"size": 2}, "python": str(PYTHON), "pythonpath": [str(ENV_DIR)],
                                   "env": {"agent": {"runtime": {"type": "subprocess"}}}})
        tasks = rows_to_tasks(load_rows(data), data, run_id="vf")
        assert [t.prompt for t in tasks] == ["What is 2 + 1?", "What is 3 + 4?"]
        assert tasks[1].metadata["verifiers"]["answer"] == "7" and tasks[0].task_id != tasks[1].task_id
        crash = dataclasses.replace(tasks[1], metadata={"verifiers": {**tasks[1].metadata["verifiers"],
                                                                      "answer": "crash"}})
        starting.join()
        server_start = time.monotonic() - started
        seen = recording(workflow)
        started = time.monotonic()
        clean, crashed = workflow.explore([tasks[0], crash], engine)
        batch_s = time.monotonic() - started
        assert clean.error is None and len(clean.samples) == 2 and clean.policy_version == 4
        for sample, calls in zip(clean.samples, seen[:2], strict=True):
            assert sample.failure == "", sample.metadata
            assert len(calls) == 2 and sample.metadata["calls"] == 2
            added = calls[1].prompt[len(calls[0].end):]
            assert sample.prompt_tokens.tolist() == calls[0].prompt
            assert sample.response_tokens.tolist() == calls[0].completion + added + calls[1].completion
            assert sample.loss_mask.tolist() == [1] * len(calls[0].completion) + [0] * len(added) + [1] * len(
                calls[1].completion)
            assert sample.logprobs[sample.loss_mask == 1].tolist() == pytest.approx(calls[0].logprobs
                                                                                    + calls[1].logprobs)
            assert all(math.isfinite(x) for x in sample.logprobs) and len(added) > 0
            assert set(sample.reward_components) == {"correct", "brief"}
            assert sample.reward == pytest.approx(0.75 * sample.reward_components["correct"]
                                                  + 0.25 * sample.reward_components["brief"])
            assert len(sample.turns or []) == 2
        assert [s.failure for s in crashed.samples] == ["verifier", "verifier"]
        assert "TaskError" in crashed.samples[0].metadata["verifiers_error"]

        assert workflow.server is not None
        short = Verifiers(explorer(address=workflow.server.client.address, episode_timeout_s=0.2), model,
                          reward=None)  # type: ignore[arg-type]
        started = time.monotonic()
        try:
            (timed_out,) = short.explore([tasks[0]], engine)
        finally:
            short.close()
        assert [s.failure for s in timed_out.samples] == ["timeout", "timeout"]
        timeout_s = time.monotonic() - started

        process = workflow.server.process
        assert process is not None
        generate = engine.generate

        def kill_first(prompts, sampling):  # the server dies while its episodes wait on the model
            if process.poll() is None:
                process.kill()
            return generate(prompts, sampling)

        engine.generate = kill_first  # type: ignore[method-assign]
        started = time.monotonic()
        (down,) = workflow.explore([tasks[1]], engine)
        down_s = time.monotonic() - started
        assert [s.failure for s in down.samples] == ["environment", "environment"]
        assert "is down" in down.samples[0].metadata["verifiers_error"] and down_s < 10
    finally:
        workflow.close()
    print(f"server start (tasks read beside it) {server_start:.1f} s, batch of 4 episodes {batch_s:.1f} s, timeouts "
          f"{timeout_s:.1f} s, down in {down_s:.1f} s")
