"""The verifiers adapter without a process: the streamed trace deltas assembled into an episode as verifiers'
EpisodeAssembly does (rft/workflows/verifiers_client.py), and an episode's record turned into a failure class, a
weighted reward and a check against the endpoint's recorded calls (rft/workflows/verifiers.py); its samples on the
wire."""
from __future__ import annotations

import math

import pytest

from rft.config import build_section
from rft.explorer.config import ExplorerConfig
from rft.schema import FAILURE_CLASSES, ExperienceGroup, decode_group, encode
from rft.workflows import WorkflowError, check_workflow_config
from rft.workflows.recording import RecordedCall
from rft.workflows.verifiers import config_problem, episode_failure, episode_sample, named_rewards, trace_mismatch
from rft.workflows.verifiers_client import EpisodeFailure, apply_delta, finish_episode


def node(content: str, sampled: bool, token_ids=(), mask=()) -> dict:
    role = "assistant" if sampled else "user"
    return {"parent": None, "message": {"role": role, "content": content}, "sampled": sampled,
            "token_ids": list(token_ids), "mask": list(mask), "logprobs": []}


def call(prompt, completion, reply: str) -> RecordedCall:
    return RecordedCall(prompt=list(prompt), completion=list(completion), logprobs=[-0.5] * len(completion),
                        finish_reason="stop", weights_version=3, reply={"role": "assistant", "content": reply})


def streamed_episode() -> dict:
    """A two-turn episode as the server streams it: opened, then nodes and calls appended, then scalars set."""
    traces: dict = {}
    apply_delta(traces, {"trace": "t1", "open": {"version": 1, "id": "t1", "task": {"type": "T"}},
                         "nodes": [node("What is 2 + 1?", False)]})
    apply_delta(traces, {"trace": "old", "open": {"id": "old"}, "nodes": [node("x", False)]})
    apply_delta(traces, {"trace": "old", "discard": True})  # a retried attempt's trace
    apply_delta(traces, {"trace": "t1", "nodes": [node("3", True)], "calls": [{"node": 1}], "pending": []})
    apply_delta(traces, {"trace": "t1", "nodes": [node("Check it.", False), node("3", True)],
                         "calls": [{"node": 3}], "set": {"ok": True, "rewards": {
                             "correct": {"score": 1.0, "weight": 0.75}, "brief": {"score": 0.0, "weight": 0.25}}}})
    reply = {"success": True, "head": {"id": "e1", "ok": True, "errors": []},
             "traces": [{"id": "t1", "nodes": 4, "calls": 2}]}
    return finish_episode(traces, reply)


def test_streamed_deltas_assemble_into_the_episode_and_a_lost_one_is_refused():
    episode = streamed_episode()
    assert [t["id"] for t in episode["traces"]] == ["t1"]
    trace = episode["traces"][0]
    assert [n["message"]["content"] for n in trace["nodes"]] == ["What is 2 + 1?", "3", "Check it.", "3"]
    assert trace["rewards"]["correct"] == {"score": 1.0, "weight": 0.75} and "pending" not in trace
    with pytest.raises(ValueError, match="assembled 1 nodes / 0 calls, the server reports 4 / 2"):
        finish_episode({"t1": {"nodes": [{}], "calls": []}}, {"head": {}, "traces": [{"id": "t1", "nodes": 4,
                                                                                      "calls": 2}]})
    with pytest.raises(ValueError, match="no header"):
        apply_delta({}, {"trace": "t2", "nodes": []})


def test_a_clean_episode_gives_the_recorded_tokens_and_the_weighted_reward():
    episode = streamed_episode()
    calls = [call([1, 2, 3], [7, 8], "3"), call([1, 2, 3, 7, 8, 4, 5], [9], "3")]
    sample = episode_sample(0, episode, calls)
    assert sample.failure == "" and sample.reward == pytest.approx(0.75)
    assert sample.reward_components == {"correct": 1.0, "brief": 0.0}
    assert sample.metadata["verifiers_weights"] == {"correct": 0.75, "brief": 0.25}
    assert sample.prompt_tokens.tolist() == [1, 2, 3]
    assert sample.response_tokens.tolist() == [7, 8, 4, 5, 9]  # completion, the environment's turn, completion
    assert sample.loss_mask.tolist() == [1, 1, 0, 0, 1]
    assert sample.logprobs.tolist() == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert sample.metadata["weights_versions"] == [3, 3]


def test_a_trace_that_disagrees_with_the_engine_is_refused():
    episode = streamed_episode()
    calls = [call([1, 2, 3], [7, 8], "3"), call([1, 2, 3, 7, 8, 4, 5], [9], "4")]
    assert trace_mismatch(episode["traces"], calls) == "turn 1: the trace's text is not the engine's reply"
    sample = episode_sample(0, episode, calls)
    assert sample.failure == "environment" and "not the engine's reply" in sample.metadata["verifiers_error"]
    assert "the endpoint recorded 1 calls" in trace_mismatch(episode["traces"], calls[:1])
    retokenised = [{"nodes": [node("3", True, token_ids=[5, 7, 8], mask=[0, 1, 1]),
                              node("3", True, token_ids=[9, 10], mask=[1, 1])]}]
    assert trace_mismatch(retokenised, calls[:1] + [call([1], [9], "3")]) == (
        "turn 1: the trace's token ids are not the engine's (re-tokenised)")
    assert trace_mismatch(retokenised, calls[:1] + [call([1], [9, 10], "3")]) == ""


@pytest.mark.parametrize(("record", "failure"), [
    ({"errors": [{"type": "TaskError", "message": "reward raised"}]}, "verifier"),
    ({"errors": [{"type": "SandboxError", "message": "exec failed"}]}, "sandbox"),
    ({"errors": [{"type": "HarnessError", "message": "exit 1"}]}, "agent"),
    ({"errors": [{"type": "EnvError", "message": "run() raised"}]}, "environment"),
    ({"is_timeout": True}, "timeout"),
    ({"ok": False}, "environment"),
])
def test_verifiers_errors_map_to_failure_classes(record, failure):
    trace = {"ok": True, "errors": [], **record}
    assert episode_failure({"ok": True}, [trace])[0] == failure
    assert failure in FAILURE_CLASSES


def test_unscored_and_unreadable_rewards_are_failures_not_zeros():
    episode = streamed_episode()
    calls = [call([1, 2, 3], [7, 8], "3"), call([1, 2, 3, 7, 8, 4, 5], [9], "3")]
    episode["traces"][0]["rewards"] = {}
    assert episode_sample(0, episode, calls).failure == "unscored"
    assert named_rewards([{"rewards": {"r": {"score": math.nan}}}]) == (
        "reward 'r': score nan / weight 1.0 is not a finite number")
    episode["traces"][0]["rewards"] = {"r": {"score": math.inf}}
    assert episode_sample(0, episode, calls).failure == "environment"


def test_a_run_without_an_episode_keeps_its_failure_and_its_recorded_tokens():
    calls = [call([1, 2, 3], [7, 8], "3")]
    sample = episode_sample(1, EpisodeFailure("timeout", "no episode within 5 s"), calls)
    assert (sample.failure, sample.sample_index, sample.response_tokens.tolist()) == ("timeout", 1, [7, 8])
    empty = episode_sample(0, EpisodeFailure("environment", "the server is down"), [])
    assert empty.failure == "environment" and len(empty.response_tokens) == 0


def test_a_config_without_an_environment_or_a_venv_is_refused_naming_the_key(tmp_path):
    with pytest.raises(WorkflowError, match="explorer.verifiers.env: the verifiers workflow needs the environment"):
        check_workflow_config(build_section(ExplorerConfig, {"workflow": "verifiers"}, source="t", prefix="explorer"))
    options = build_section(ExplorerConfig, {"workflow": "verifiers", "verifiers": {
        "env": {"taskset": {"id": "x"}}, "python": str(tmp_path / "missing")}}, source="t", prefix="explorer")
    check_workflow_config(options)  # a config loads where the explorer may not run
    assert config_problem(options.verifiers).startswith("explorer.verifiers.python: the verifiers venv's interpreter")


def test_its_samples_cross_the_wire_failed_ones_included():
    calls = [call([1, 2, 3], [7, 8], "3"), call([1, 2, 3, 7, 8, 4, 5], [9], "3")]
    samples = [episode_sample(0, streamed_episode(), calls),
               episode_sample(1, EpisodeFailure("timeout", "no episode within 5 s"), calls[:1]),
               episode_sample(2, EpisodeFailure("environment", "the server is down"), [])]
    for s in samples:
        s.metadata.pop("weights_versions")
    group = ExperienceGroup(run_id="r", task_id="t", group_id="t:0", attempt=0, explorer_id="e0", policy_version=3,
                            samples=samples)
    value, headers = encode(group)
    assert decode_group(value, headers).samples == samples
    assert [s.failure for s in group.scored_samples] == [""]
