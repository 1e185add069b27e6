"""ReMax end to end in one process: its advantage against the formula in plain Python (r_i - r_greedy), its loss as
GRPO's; the group's `greedy_reward` (range check, the trainer's check); the trainer's loop (stand-in policy, the
in-memory transport) training on r - r_greedy and dead-lettering a group without a baseline; the single_turn workflow
on the tiny model (transformers engine) scoring one greedy completion per task, checked against an independent greedy
decode; and the config: remax turns explorer.greedy_baseline on, and workflows, loops and modes that cannot record the
baseline are refused when the config loads.
"""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from rft.algorithms import build_algorithm, group_advantages
from rft.algorithms.config import AlgorithmConfig
from rft.config import ConfigError
from rft.engine import TransformersEngine
from rft.evaluation.config import EvalConfig, EvalSetConfig
from rft.evaluation.main import sampling_explorer
from rft.rewards import build_reward, resolve
from rft.run.loading import run_config_from_dict
from rft.schema import HEADER_ERROR, RewardRange, TaskRecord
from rft.trainer.batch import TrainableLimits
from rft.transport.memory import MemoryTransport
from rft.workflows import build_workflow
from tests.records import make_group, read_topic
from tests.unit.test_algorithms import random_batch, torch_loss_and_grad
from tests.unit.test_trainer_loop import StandInPolicy, build, fill, make_config

# ------------------------------------------------------------------------------------------------ the formula


def reference_advantages(rewards_per_group, baselines):
    """A_i = r_i - r_greedy, sample by sample."""
    return [[float(r) - float(b) for r in rewards] for rewards, b in zip(rewards_per_group, baselines, strict=True)]


def test_remax_advantage_is_each_reward_minus_the_greedy_reward():
    rng = np.random.default_rng(0)
    rewards = [rng.normal(size=n) for n in (1, 2, 5, 8)]  # a group of one keeps its advantage (no group baseline)
    baselines = list(rng.normal(size=4))
    remax = build_algorithm(AlgorithmConfig.of("remax"))
    assert remax.needs.greedy_baseline and not remax.needs.reference
    got = remax.baseline_advantages(rewards, baselines)
    for ours, ref in zip(got, reference_advantages(rewards, baselines), strict=True):
        assert ours.dtype == np.float32
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)
    # std_normalize does not apply, kl_coef > 0 loads the reference as grpo's
    plain = build_algorithm(AlgorithmConfig.of("remax", std_normalize=False)).baseline_advantages(rewards, baselines)
    assert all(np.array_equal(a, b) for a, b in zip(got, plain, strict=True))
    assert build_algorithm(AlgorithmConfig.of("remax", kl_coef=0.1)).needs == dataclasses.replace(
        remax.needs, reference=True)


def test_remax_loss_is_grpo_loss_on_its_advantages():
    batch = random_batch(3)
    ours = torch_loss_and_grad(build_algorithm(AlgorithmConfig.of("remax")), batch)
    theirs = torch_loss_and_grad(build_algorithm(AlgorithmConfig.of("grpo")), batch)
    assert ours[0] == pytest.approx(theirs[0]) and math.isfinite(ours[0])
    np.testing.assert_allclose(ours[1], theirs[1])


def test_remax_refuses_advantages_without_a_baseline():
    remax = build_algorithm(AlgorithmConfig.of("remax"))
    with pytest.raises(ValueError, match="need each group's greedy reward"):
        remax.advantages([np.array([1.0, 0.0])])
    with pytest.raises(ValueError, match="1 greedy rewards for 2 groups"):
        remax.baseline_advantages([np.array([1.0]), np.array([0.0])], [0.5])
    with pytest.raises(ValueError, match="group 0 has a non-finite greedy reward"):
        remax.baseline_advantages([np.array([1.0])], [math.nan])
    groups = [make_group("run", 0, rewards=[1.0, 0.0]), make_group("run", 1, rewards=[0.5, 0.5])]
    groups[0].greedy_reward = 0.25
    with pytest.raises(ValueError, match="group run/task-1/e0 has no greedy_reward"):
        group_advantages(remax, groups)
    groups[1].greedy_reward = 1.0
    assert [a.tolist() for a in group_advantages(remax, groups)] == [[0.75, -0.25], [-0.5, -0.5]]
    # an algorithm without the need is given the rewards alone
    [grpo] = group_advantages(build_algorithm(AlgorithmConfig.of("grpo")), groups[:1])
    assert grpo.tolist() == pytest.approx([0.7071, -0.7071], abs=1e-4)


# ------------------------------------------------------------------------------------ the group's greedy_reward


def test_the_trainers_check_wants_a_greedy_reward_in_range():
    limits = TrainableLimits(vocab_size=128, max_prompt_len=64, max_response_len=64, rewards=RewardRange(-1, 1),
                             greedy_baseline=True)
    group = make_group("run", 0, rewards=[1.0, 0.0])
    assert limits.problem(group).startswith("no greedy_reward: the algorithm subtracts the reward of each task's")
    assert dataclasses.replace(limits, greedy_baseline=False).problem(group) is None
    group.greedy_reward = 0.5
    assert limits.problem(group) is None
    group.greedy_reward = 2.0  # the explorer's delivery checks the same range (RewardRange.group_problem)
    assert limits.problem(group) == "greedy_reward: reward 2.0 is outside run.reward_min..run.reward_max [-1, 1]"
    assert RewardRange(-1, 1).group_problem(group) == limits.problem(group)


class RecordingPolicy(StandInPolicy):
    """StandInPolicy that also keeps the advantages of the rows in the loss, per step."""

    def __init__(self, trained):
        super().__init__(trained)
        self.advantages: list[list[float]] = []

    def train_step(self, micro_batches, loss_fn):
        self.advantages.append(sorted(float(a) for mb in micro_batches
                                      for a, m in zip(mb["advantages"], mb["loss_mask"], strict=True) if m.sum() > 0))
        return super().train_step(micro_batches, loss_fn)


def test_the_trainer_trains_on_reward_minus_greedy_and_dead_letters_a_group_without(tmp_path):
    cfg = make_config(tmp_path).with_values({"algorithm.name": "remax", "run.max_steps": 2})
    groups = [make_group("run", i, rewards=[1.0, 0.0, 0.5]) for i in range(5)]
    for g, baseline in zip(groups, [0.5, 1.0, None, 0.0, 0.25], strict=True):
        g.greedy_reward = baseline  # task 2 was explored without a baseline
    transport = MemoryTransport(partitions=1)
    fill(transport, cfg, groups)
    policy = RecordingPolicy([])
    trainer = build(cfg, transport, [], policy)
    try:
        trainer.run()
    finally:
        trainer.close()
    assert policy.advantages == [sorted([0.5, -0.5, 0.0, 0.0, -1.0, -0.5]),  # tasks 0 and 1
                                          sorted([1.0, 0.0, 0.5, 0.75, -0.25, 0.25])]  # tasks 3 and 4
    [dead] = read_topic(transport, cfg.topic("dead_letter"))
    assert dict(dead.headers)[HEADER_ERROR].decode().startswith("cannot be trained: no greedy_reward: ")
    metrics = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped"] for m in metrics if m.get("step") == 2] == [{"untrainable": 1}]


# ------------------------------------------------------------------------------------- the explorer's workflow

ALPHABET = "0123456789"


def tasks(n: int) -> list[TaskRecord]:
    return [TaskRecord("r", f"t{i}", 0, f":{ALPHABET[i]}", ALPHABET[i], {"alphabet": ALPHABET}) for i in range(n)]


def greedy_decode(engine, prompt, *, max_tokens: int) -> str:
    """The argmax continuation of `prompt` by the engine's model, one forward pass a token, up to the first token
    that ends a completion, as text."""
    ids = [int(t) for t in prompt]
    new: list[int] = []
    with torch.no_grad():
        while len(new) < max_tokens and not (new and new[-1] in engine.stops):
            new.append(int(engine.model(torch.tensor([ids + new])).logits[0, -1].argmax()))
    return engine.tokenizer.decode(new, skip_special_tokens=True)


def remax_config(tiny_model, **explorer):
    return run_config_from_dict({
        "model": {"path": str(tiny_model), "max_response_len": 48}, "algorithm": {"name": "remax"},
        "explorer": {"engine": "transformers", "reward": "char_accuracy", "n_samples": 3, "max_tokens": 6,
                     "temperature": 1.0, **explorer}})


def test_single_turn_scores_one_greedy_completion_per_task(tiny_model):
    cfg = remax_config(tiny_model)
    assert cfg.explorer.greedy_baseline  # remax turned it on
    engine = TransformersEngine(tiny_model, seed=0)
    todo = tasks(3) + [TaskRecord("r", "long", 0, "x " * 400, "1", {"alphabet": ALPHABET})]
    results = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer)).explore(todo, engine)
    char_accuracy = resolve("char_accuracy")[1]
    greedy_rewards = []
    for result in results[:3]:
        assert result.error is None and len(result.samples) == 3  # the greedy completion is not a sample
        text = greedy_decode(engine, result.samples[0].prompt_tokens, max_tokens=6)
        assert result.greedy_reward == pytest.approx(char_accuracy(text, result.task).score)
        greedy_rewards.append(result.greedy_reward)
    assert results[3].error.startswith("prompt is") and results[3].greedy_reward is None
    off = dataclasses.replace(cfg.explorer, greedy_baseline=False)
    assert all(r.greedy_reward is None for r in build_workflow(off, cfg.model, build_reward(off)).explore(
        tasks(2), engine))
    # evaluation samples its own way, with no greedy baseline
    evaluation = EvalConfig(sets=[EvalSetConfig(name="e", path="copy_char", format="generated")])
    assert not sampling_explorer(cfg.explorer, evaluation, evaluation.sets[0]).greedy_baseline


# ------------------------------------------------------------------------------------------------- the config

@pytest.mark.parametrize("explorer,run,says", [
    ({"workflow": "multi_turn"}, {}, "explorer.workflow: workflow multi_turn does not record each task's greedy "
                                     "reward (explorer.greedy_baseline); workflows that do: single_turn; algorithm "
                                     "'remax' subtracts"),
    ({"continuous": True, "engine": "vllm"}, {}, "explorer.continuous: the continuous loop generates no greedy"),
    ({}, {"mode": "serve"}, "run.mode: serve trains on served traffic, which has no greedy response"),
], ids=["multi_turn", "continuous", "serve"])
def test_remax_is_refused_where_no_greedy_baseline_can_be_recorded(tiny_model, explorer, run, says):
    with pytest.raises(ConfigError, match="^<dict>: " + says.replace("(", r"\(").replace(")", r"\)")):
        run_config_from_dict({"model": {"path": str(tiny_model)}, "algorithm": {"name": "remax"},
                              "explorer": explorer, "run": run})


def test_the_greedy_baseline_key_alone_is_checked_and_offline_remax_needs_no_explorer(tiny_model):
    with pytest.raises(ConfigError, match="explorer.workflow: workflow multi_turn does not record"):
        run_config_from_dict({"model": {"path": str(tiny_model)},
                              "explorer": {"workflow": "multi_turn", "greedy_baseline": True}})
    cfg = run_config_from_dict({"model": {"path": str(tiny_model)}, "algorithm": {"name": "remax"},
                                "run": {"mode": "offline"}, "explorer": {"workflow": "multi_turn"}})
    assert cfg.explorer.greedy_baseline
    assert not run_config_from_dict({"model": {"path": str(tiny_model)}}).explorer.greedy_baseline
