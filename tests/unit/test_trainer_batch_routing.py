"""Routing replay in the batch contract (rft/trainer/batch.py): recorded expert ids land on the input positions they
were recorded for, -1 elsewhere; cut with the row; one set of MoE layers per step."""
from __future__ import annotations

import numpy as np
import pytest

from rft.schema import RoutedExperts
from rft.trainer.batch import plan_micro_batches, replayed_fraction, rows_from_groups
from tests.records import make_group


def record(prompt_len, response_len, *, first_position=0, layers=(0, 2), seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 8, (prompt_len + response_len - 1 - first_position, len(layers), 2)).astype(np.uint8)
    return RoutedExperts(ids=ids, num_experts=8, layers=list(layers), first_position=first_position)


def test_ids_sit_on_their_input_positions_and_unrecorded_ones_are_minus_one():
    group = make_group("run", 1, n_samples=3, prompt_len=4, response_len=5)
    group.samples[0].routed_experts = record(4, 5)
    group.samples[1].routed_experts = record(4, 5, first_position=3)  # only the generated tokens' forward passes
    rows = rows_from_groups([group], [np.zeros(3)], routing=True)
    mb = plan_micro_batches(rows, dp_size=1, micro_batch_size=4).for_rank(0)[0]
    ids, layers = mb["routed_experts"].numpy(), mb["routed_layers"].tolist()
    assert ids.shape == (4, 8, 2, 2) and layers == [0, 2]
    assert np.array_equal(ids[0], group.samples[0].routed_experts.ids)
    assert (ids[1, :3] == -1).all() and np.array_equal(ids[1, 3:], group.samples[1].routed_experts.ids)
    assert (ids[2:] == -1).all()  # a sample without a record, and the padding row
    # of the 15 loss tokens, the 10 of the two recorded samples have their forward pass recorded
    assert replayed_fraction(rows) == pytest.approx(10 / 15)
    assert "routed_experts" not in plan_micro_batches(rows_from_groups([group], [np.zeros(3)]), dp_size=1,
                                                       micro_batch_size=4).for_rank(0)[0]  # replay off: not carried


def test_a_cut_row_keeps_its_routing_aligned_and_layers_must_agree():
    group = make_group("run", 1, n_samples=2, prompt_len=4, response_len=5)
    for s in group.samples:
        s.routed_experts = record(4, 5)
    rows = rows_from_groups([group], [np.zeros(2)], max_len=6, routing=True)
    assert rows[0].routed.shape == (5, 2, 2) and np.array_equal(rows[0].routed, group.samples[0].routed_experts.ids[:5])
    other = make_group("run", 2, n_samples=1, prompt_len=4, response_len=5)
    other.samples[0].routed_experts = record(4, 5, layers=(0, 1))
    with pytest.raises(ValueError, match="group run/task-2/e0: routed_experts of MoE layers"):
        rows_from_groups([group, other], [np.zeros(2), np.zeros(1)], routing=True)
