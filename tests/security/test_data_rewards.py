"""Issue 29, items 3 and 4 (unit level, in memory): no poisoning through rewards, no crash loop.

The attack of the issue: two feedback calls with `reward: 1e308` make GRPO's advantages NaN (the group mean
overflows), and nothing between there and the optimizer stopped it. Each entry point now accepts only finite
rewards in run.reward_min .. reward_max: the trainer's feed dead-letters a group outside it (here), `rft serve`
answers 400 (test_data_serve_feedback.py), explorers dead-letter the task. Behind that: a step with non-finite
advantages is skipped and counted, non-finite weights are never published, and a stored version holding NaN is
refused by every engine that follows the store (explorers and `rft serve`: WeightUpdates).

A group that decodes but cannot be trained (empty prompt or response, ids outside the vocabulary, over the length
limits) is dead-lettered with its reason and consumed, so the trainer goes on (and a resumed one never meets it).
The stand-ins (in-memory transport, StandInPolicy) are those of tests/unit/test_trainer_loop.py; the same with a
real broker and megatron under torchrun is tests/distributed/test_data_untrainable.py.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rft.algorithms import build_algorithm
from rft.algorithms.config import AlgorithmConfig
from rft.schema import HEADER_ERROR, RewardRange, decode_group
from rft.trainer.main import Trainer, open_trainer_io
from rft.trainer.weights import NonFiniteWeights
from rft.transport.control import Weights
from rft.transport.memory import MemoryTransport
from rft.weights.store import WeightStore
from rft.weights.subscriber import WeightUpdates, load_newest_weights
from tests.records import make_group, read_topic
from tests.unit.test_trainer_loop import StandInPolicy, fill, make_config


def run_trainer(cfg, items, policy_class=StandInPolicy):
    """Run the loop of `cfg` (3 steps of 2 groups) over `items` with no staleness bound; (transport, the policy's
    steps, metrics by step)."""
    cfg = cfg.with_values({"run.mode": "async"})
    transport = MemoryTransport(partitions=1)
    fill(transport, cfg, items)
    trained: list = []
    trainer = Trainer(cfg.trainer, run=cfg.run, model=cfg.model, algorithm=cfg.algorithm, sync=cfg.sync,
                      run_dir=cfg.run_dir, temperature=1.0, progress=False, policy=policy_class(trained),
                      open_io=lambda feed_state, replay_state: open_trainer_io(
                          cfg, feed_state=feed_state, replay_state=replay_state, transport=transport))
    try:
        trainer.run()
    finally:
        trainer.close()
    metrics = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return transport, trained, {m["step"]: m for m in metrics if "step" in m}


def reasons(transport, cfg) -> list[str]:
    return [dict(m.headers)[HEADER_ERROR].decode() for m in read_topic(transport, cfg.topic("dead_letter"))]


def test_the_attack_two_rewards_of_1e308_make_grpo_advantages_nan():
    """The premise: what a reward of 1e308 does to GRPO when nothing stops it."""
    grpo = build_algorithm(AlgorithmConfig.of("grpo"))
    with np.errstate(over="ignore", invalid="ignore"):
        [advantages] = grpo.advantages([np.array([1e308, 1e308, 0.0, 0.0])])
    assert not np.all(np.isfinite(advantages))
    assert RewardRange(-1e6, 1e6).problem(1e308) and RewardRange(-1e6, 1e6).problem(float("nan"))
    assert RewardRange(-1e6, 1e6).problem(True) and RewardRange(-1e6, 1e6).problem(0.5) is None


def test_the_trainer_dead_letters_a_poisoned_group_and_trains_on(tmp_path):
    cfg = make_config(tmp_path)
    poisoned = make_group("run", 7, rewards=[1e308, 1e308, 0.0, 0.0])
    good = [make_group("run", i, n_samples=3) for i in range(6)]
    transport, trained, by_step = run_trainer(cfg, [good[0], poisoned, *good[1:]])
    assert len(trained) == 3  # every step trained, on good groups only
    assert by_step[1]["skipped"] == {"untrainable": 1}
    [reason] = reasons(transport, cfg)
    assert reason.startswith("cannot be trained: samples[0]: reward 1e+308 is outside run.reward_min")


@pytest.mark.parametrize("spoil,says", [
    (lambda s: setattr(s, "prompt_tokens", s.prompt_tokens[:0]), "empty prompt"),
    (lambda s: (setattr(s, "response_tokens", s.response_tokens[:0]), setattr(s, "logprobs", s.logprobs[:0]),
                setattr(s, "loss_mask", s.loss_mask[:0])), "empty response"),
    (lambda s: s.response_tokens.__setitem__(0, 5000), "response token id 5000 is outside the vocabulary [0, 128)"),
    (lambda s: s.prompt_tokens.__setitem__(0, -3), "prompt token id -3 is outside the vocabulary"),
    (lambda s: setattr(s, "prompt_tokens", np.arange(300, dtype=np.int32) % 100), "over model.max_prompt_len=256"),
    (lambda s: (setattr(s, "response_tokens", np.ones(65, np.int32)), setattr(s, "logprobs", -np.ones(65, np.float32)),
                setattr(s, "loss_mask", np.ones(65, np.uint8))), "over model.max_response_len=64"),
], ids=["empty_prompt", "empty_response", "id_past_vocab", "negative_id", "long_prompt", "long_response"])
def test_an_untrainable_group_is_dead_lettered_with_its_reason_and_the_trainer_goes_on(tmp_path, spoil, says):
    """Each of these crashed the trainer (an index past the embedding, an empty row) before the feed checked them;
    arrays of different lengths are refused by the decoder already (tests/unit/test_schema.py)."""
    cfg = make_config(tmp_path)
    bad = make_group("run", 9, n_samples=3)
    bad.samples[1].prompt_tokens = bad.samples[1].prompt_tokens.copy()
    bad.samples[1].response_tokens = bad.samples[1].response_tokens.copy()
    spoil(bad.samples[1])
    good = [make_group("run", i, n_samples=3) for i in range(6)]
    transport, trained, by_step = run_trainer(cfg, [good[0], good[1], good[2], bad, *good[3:]])
    assert len(trained) == 3
    assert by_step[2]["skipped"] == {"untrainable": 1}
    [dead] = read_topic(transport, cfg.topic("dead_letter"))
    reason = dict(dead.headers)[HEADER_ERROR].decode()
    assert reason.startswith("cannot be trained: samples[1]: ") and says in reason, reason
    assert decode_group(dead.value, dead.headers).group_id == bad.group_id  # the record itself, byte for byte


def test_a_step_with_non_finite_advantages_is_skipped_and_counted(tmp_path):
    """With the range opened wide (run.reward_max 1e308), the poisoned group reaches the step: its advantages
    are NaN, so no optimizer step is taken, the step is counted, and the weights published are still finite."""
    cfg = make_config(tmp_path)
    cfg = cfg.with_values({"run.reward_min": -1e308, "run.reward_max": 1e308})
    groups = [make_group("run", 0, n_samples=3), make_group("run", 1, rewards=[1e308, 1e308, 0.0, 0.0]),
              *[make_group("run", i, n_samples=3) for i in range(2, 6)]]
    with np.errstate(over="ignore", invalid="ignore"):
        _, trained, by_step = run_trainer(cfg, groups)
    assert len(trained) == 2  # step 1 had the poisoned group: no policy step
    assert by_step[1]["step_skipped"] == 1.0 and by_step[1]["nonfinite_advantages"] == 1.0
    assert [by_step[s]["steps_skipped_total"] for s in (1, 2, 3)] == [1, 1, 1]


class PoisonedPolicy(StandInPolicy):
    """Its weights turn NaN at its second optimizer step."""

    def weights_finite(self) -> bool:
        return self.steps < 2


def test_non_finite_weights_are_never_published(tmp_path):
    cfg = make_config(tmp_path)
    with pytest.raises(NonFiniteWeights, match="step 2: the policy's weights hold NaN"):
        run_trainer(cfg, [make_group("run", i, n_samples=3) for i in range(6)], policy_class=PoisonedPolicy)
    assert WeightStore.for_sync(cfg.sync, cfg.run_dir).latest()[0] == 1


class Engine:
    def __init__(self):
        self.weights_version, self.loads = 0, []

    def load_weights(self, path, version: int) -> None:
        self.loads.append(version)
        self.weights_version = version


def test_engines_refuse_a_stored_version_holding_nan(tmp_path):
    """What explorers and `rft serve` load goes through WeightUpdates (sync.verify, the default)."""
    transport = MemoryTransport()
    transport.admin().create_topics(["run.control"])
    source = transport.source()
    source.assign(["run.control"])
    store = WeightStore(tmp_path / "store", keep=10)
    updates, engine = WeightUpdates(store, source), Engine()
    store.publish(1, [{"a.weight": torch.ones(4, 4)}], hf_dir=None)
    step = lambda: load_newest_weights(engine, lambda: updates.newest(above=engine.weights_version))  # noqa: E731
    assert step()[0] == 1
    poisoned = torch.ones(4, 4)
    poisoned[2, 3] = float("nan")
    path = store.publish(2, [{"a.weight": poisoned}], hf_dir=None)
    sink = transport.sink()
    sink.send_record("run.control", Weights(version=2, path=str(path)).to_message())
    sink.flush()
    assert step() is None and engine.loads == [1] and updates.refused == 1
