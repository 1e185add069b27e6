"""Trainer batches from known groups (rft/trainer/batch.py): preference pairs stay together across data-parallel
ranks and micro-batches and carry pair_chosen / pair_index; the trainer refuses a data-parallel size that does not
match its world size."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from rft.algorithms import build_algorithm
from rft.config import AlgorithmConfig, ConfigError, TrainerConfig
from rft.schema import ExperienceGroup, Sample
from rft.trainer.batch import micro_batches_for_rank, preference_pair_problem, rows_from_groups
from rft.trainer.main import check_parallel_layout

REPO = Path(__file__).resolve().parents[2]


def sample(index: int, prompt: list[int], response: list[int], reward: float) -> Sample:
    return Sample(sample_index=index, prompt_tokens=np.array(prompt, np.int32),
                  response_tokens=np.array(response, np.int32),
                  logprobs=-np.arange(1, len(response) + 1, dtype=np.float32) / 10,
                  loss_mask=np.ones(len(response), np.uint8), reward=reward)


def group(number: int, rewards: tuple[float, ...]) -> ExperienceGroup:
    """Group `number`: prompt [number+10, 7], responses of 3 tokens [100*number + 10*j + 1, +2, +3]."""
    samples = [sample(j, [number + 10, 7], [100 * number + 10 * j + k for k in (1, 2, 3)], r)
               for j, r in enumerate(rewards)]
    return ExperienceGroup(run_id="run", task_id=f"t{number}", group_id=f"g{number}", attempt=0, explorer_id="e",
                           policy_version=0, samples=samples)


# pair 0 prefers its first sample, pairs 1 and 2 their second
PAIRS = [group(0, (1.0, 0.0)), group(1, (0.2, 0.7)), group(2, (-1.0, 0.5))]


def pair_batches(dp_rank: int, *, dp_size: int = 2, micro_batch_size: int = 2):
    rows = rows_from_groups(PAIRS, [np.zeros(2, np.float32)] * 3, pairs=True)
    return micro_batches_for_rank(rows, dp_rank=dp_rank, dp_size=dp_size, micro_batch_size=micro_batch_size)


def test_pairs_are_dealt_whole_with_chosen_and_index():
    rank0, rank1 = pair_batches(0), pair_batches(1)
    assert len(rank0) == len(rank1) == 2  # 3 pairs over 2 ranks: 2 micro-batches each, one of them padding
    # rank 0 holds pairs 0 and 2, rank 1 pair 1 and a padding micro-batch
    assert [mb["pair_index"].tolist() for mb in rank0] == [[0, 0], [2, 2]]
    assert [mb["pair_index"].tolist() for mb in rank1] == [[1, 1], [-1, -1]]
    assert [mb["pair_chosen"].tolist() for mb in rank0] == [[True, False], [False, True]]
    assert [mb["pair_chosen"].tolist() for mb in rank1] == [[False, True], [False, False]]
    assert rank0[0]["pair_chosen"].dtype == torch.bool and rank0[0]["pair_index"].dtype == torch.int64
    padding = rank1[1]
    assert padding["loss_mask"].sum() == 0 and padding["input_ids"].sum() == 0
    for mb in rank0 + rank1:
        assert mb["global_sequences"].item() == 6.0 and mb["global_tokens"].item() == 18.0
    # pair 2, rejected row: tokens [12, 7, 201, 202, 203]; targets are the tokens shifted by one
    first = rank0[1]
    assert first["input_ids"][0].tolist() == [12, 7, 201, 202]
    assert first["target_ids"][0].tolist() == [7, 201, 202, 203]
    assert first["loss_mask"][0].tolist() == [0.0, 1.0, 1.0, 1.0]
    np.testing.assert_allclose(first["old_logprobs"][0].numpy(), [0.0, -0.1, -0.2, -0.3], rtol=1e-6)


def test_dpo_loss_accepts_the_pair_micro_batches_and_sums_to_the_whole_batch():
    dpo = build_algorithm(AlgorithmConfig(name="dpo", dpo_beta=0.5))

    def loss_of(batches):
        total = 0.0
        for mb in batches:
            logp = -torch.arange(mb["loss_mask"].numel(), dtype=torch.float32).reshape(mb["loss_mask"].shape) / 7
            mb["ref_logprobs"] = torch.full_like(logp, -0.3) * mb["loss_mask"]
            total += dpo.loss_fn(logp + mb["pair_index"][:, None] * 0.1, mb)[0].item()
        return total

    whole = rows_from_groups(PAIRS, [np.zeros(2, np.float32)] * 3, pairs=True)
    single = micro_batches_for_rank(whole, dp_rank=0, dp_size=1, micro_batch_size=6)
    sharded = pair_batches(0) + pair_batches(1)
    assert loss_of(sharded) == pytest.approx(loss_of(single), rel=1e-6)


def test_groups_that_are_not_pairs():
    assert preference_pair_problem(PAIRS[0]) is None
    assert preference_pair_problem(group(5, (0.5, 0.5))) == "tied_pair"
    assert preference_pair_problem(group(6, (0.1, 0.2, 0.3))) == "not_a_pair"
    with pytest.raises(ValueError, match=r"group g5: tied_pair, not a preference pair .* rewards \[0.5, 0.5\]"):
        rows_from_groups([group(5, (0.5, 0.5))], [np.zeros(2)], pairs=True)
    with pytest.raises(ValueError, match=r"trainer.micro_batch_size must be even for preference pairs .*got 3"):
        pair_batches(0, micro_batch_size=3)


def test_single_rows_are_dealt_round_robin_without_pair_fields():
    groups = [group(0, (1.0, 0.0, 0.5)), group(1, (0.0, 1.0, 0.5))]
    advantages = [np.array([1, 2, 3], np.float32), np.array([4, 5, 6], np.float32)]
    rows = rows_from_groups(groups, advantages)
    rank1 = micro_batches_for_rank(rows, dp_rank=1, dp_size=2, micro_batch_size=2)
    assert [mb["advantages"].tolist() for mb in rank1] == [[2.0, 4.0], [6.0, 0.0]]
    assert "pair_index" not in rank1[0] and "pair_chosen" not in rank1[0]


def test_data_parallel_must_match_the_world_size():
    check_parallel_layout(TrainerConfig(tensor_parallel=2, pipeline_parallel=2, data_parallel=2), 8)
    with pytest.raises(ConfigError, match=r"trainer.data_parallel is 1, but world size 8 .* = 4: set "
                                          r"trainer.data_parallel=4 or start 2 processes"):
        check_parallel_layout(TrainerConfig(tensor_parallel=2, data_parallel=1), 8)
    with pytest.raises(ConfigError, match="= 2 x 2 does not divide the world size 6"):
        check_parallel_layout(TrainerConfig(tensor_parallel=2, pipeline_parallel=2), 6)


def test_trainer_command_exits_2_naming_data_parallel(tmp_path):
    """Started as one process (no torchrun) with data_parallel 2: refused before any model is loaded."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"run": {"name": "dp-check", "mode": "train", "output_dir": str(tmp_path)},
                                      "model": {"path": str(tmp_path / "no-model")},
                                      "kafka": {"bootstrap_servers": "127.0.0.1:1"},
                                      "trainer": {"data_parallel": 2}}))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "rft.cli", "trainer", str(config)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "trainer.data_parallel is 2, but world size 1" in result.stderr
    assert "set trainer.data_parallel=1" in result.stderr
