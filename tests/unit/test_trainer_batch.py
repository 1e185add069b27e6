"""Trainer batches from known groups (rft/trainer/batch.py): preference pairs stay together across data-parallel
ranks and micro-batches and carry pair_chosen / pair_index; the trainer refuses a data-parallel size that does not
match its world size; token-budget plans (trainer.max_tokens_per_micro_batch) place every row once, respect the
budget, keep pairs together and give every rank the same number of micro-batches; the micro-batching keys are
checked."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from rft.algorithms import build_algorithm
from rft.algorithms.config import AlgorithmConfig
from rft.config import ConfigError
from rft.schema import ExperienceGroup, Sample
from rft.trainer.batch import micro_batches_for_rank, plan_micro_batches, preference_pair_problem, rows_from_groups
from rft.trainer.config import TrainerConfig
from rft.trainer.main import check_parallel_layout


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
    dpo = build_algorithm(AlgorithmConfig.of(name="dpo", dpo_beta=0.5))

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


def varied_rows(n: int = 40, *, pairs: bool = False, seed: int = 3):
    """`n` rows of 4 to 60 tokens (prompt 2), as single rows or `n // 2` preference pairs."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n // 2):
        samples = [sample(j, [g + 10, 7], list(rng.integers(3, 90, int(rng.integers(2, 59)))), float(j == 0))
                   for j in range(2)]
        groups.append(ExperienceGroup(run_id="run", task_id=f"t{g}", group_id=f"g{g}", attempt=0, explorer_id="e",
                                      policy_version=0, samples=samples))
    return rows_from_groups(groups, [np.array([1.0, -1.0], np.float32)] * len(groups), pairs=pairs)


@pytest.mark.parametrize("dp_size", [1, 2, 3])
@pytest.mark.parametrize("budget", [1, 64, 200, 10_000])
def test_token_budget_plan_loses_no_row_respects_the_budget_and_gives_ranks_equal_counts(dp_size, budget):
    rows = varied_rows()
    plan = plan_micro_batches(rows, dp_size=dp_size, micro_batch_size=8, max_tokens_per_micro_batch=budget)
    placed = [id(r) for rank in plan.ranks for micro, _, _ in rank for r in micro]
    assert sorted(placed) == sorted(id(r) for r in rows)  # every row exactly once
    assert len({len(rank) for rank in plan.ranks}) == 1  # the same number of micro-batches on every rank
    for rank in plan.ranks:
        for micro, batch_size, seq_len in rank:
            if not micro:
                assert (batch_size, seq_len) == (1, 1)  # an empty micro-batch, for equal counts
                continue
            assert batch_size == len(micro) and seq_len == max(len(r.tokens) for r in micro) - 1
            assert batch_size * seq_len <= budget or batch_size == 1  # a longer row goes alone
    assert plan.real_tokens == sum(len(r.tokens) - 1 for r in rows)
    slots = sum(b * t for rank in plan.ranks for _, b, t in rank)
    assert plan.padding_fraction == pytest.approx(1 - plan.real_tokens / slots)
    for dp_rank in range(dp_size):
        for mb, (micro, _, _) in zip(plan.for_rank(dp_rank), plan.ranks[dp_rank], strict=True):
            assert mb["row_lens"][:len(micro)].tolist() == [len(r.tokens) - 1 for r in micro]
            assert mb["global_sequences"].item() == len(rows)
            assert mb["global_tokens"].item() == sum(r.loss_mask.sum() for r in rows)


def test_token_budget_groups_rows_by_length_and_cuts_padding():
    rows = varied_rows()
    fixed = plan_micro_batches(rows, dp_size=2, micro_batch_size=8)
    budget = plan_micro_batches(rows, dp_size=2, micro_batch_size=8, max_tokens_per_micro_batch=256)
    # fixed: every micro-batch is [8, longest row of the step]
    longest = max(len(r.tokens) for r in rows) - 1
    assert {(b, t) for rank in fixed.ranks for _, b, t in rank} == {(8, longest)}
    assert fixed.padding_fraction > 0.4 and budget.padding_fraction < 0.15, (fixed.padding_fraction,
                                                                              budget.padding_fraction)
    # one long row alone: its own micro-batch, padded to itself
    single = plan_micro_batches(rows[:1], dp_size=1, micro_batch_size=8, max_tokens_per_micro_batch=2)
    assert [(b, t) for _, b, t in single.ranks[0]] == [(1, len(rows[0].tokens) - 1)]
    assert single.padding_fraction == 0.0


def test_token_budget_keeps_preference_pairs_in_one_micro_batch():
    rows = varied_rows(pairs=True)
    plan = plan_micro_batches(rows, dp_size=2, micro_batch_size=2, max_tokens_per_micro_batch=150)
    seen = []
    for dp_rank in range(2):
        for mb in plan.for_rank(dp_rank):
            real = mb["pair_index"][mb["pair_index"] >= 0].tolist()
            assert all(real.count(p) == 2 for p in real)  # both rows of each pair here
            assert mb["pair_chosen"][mb["pair_index"] >= 0].sum() == len(real) // 2
            seen += sorted(set(real))
    assert sorted(seen) == list(range(20))


def test_the_default_plan_is_the_fixed_round_robin_one():
    rows = varied_rows(10)
    old = [micro_batches_for_rank(rows, dp_rank=d, dp_size=2, micro_batch_size=2) for d in range(2)]
    plan = plan_micro_batches(rows, dp_size=2, micro_batch_size=2)
    for d in range(2):
        a = 1.0 if d == 0 else -1.0  # even rows are the first samples (advantage 1), odd rows the second
        assert [mb["advantages"].tolist() for mb in old[d]] == [[a, a], [a, a], [a, 0.0]]
        for before, now in zip(old[d], plan.for_rank(d), strict=True):
            assert all(torch.equal(before[k], now[k]) for k in before)
        assert [r for micro, _, _ in plan.ranks[d] for r in micro] == rows[d::2]


@pytest.mark.parametrize("overrides, message", [
    ({"max_tokens_per_micro_batch": -1}, r"trainer.max_tokens_per_micro_batch: must be >= 0 \(0: off"),
    ({"max_tokens_per_micro_batch": 512, "pipeline_parallel": 2, "data_parallel": 1},
     r"trainer.max_tokens_per_micro_batch: needs trainer.pipeline_parallel 1 .*got pipeline_parallel 2"),
    ({"pack_sequences": True, "pipeline_parallel": 2}, r"trainer.pack_sequences: needs trainer.pipeline_parallel 1"),
])
def test_micro_batching_keys_are_checked(tmp_path, overrides, message):
    from rft.run.config import load_config

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"run": {"name": "mb-check", "output_dir": str(tmp_path)},
                                      "model": {"path": str(tmp_path)}, "trainer": overrides}))
    with pytest.raises(ConfigError, match=message):
        load_config(config)


