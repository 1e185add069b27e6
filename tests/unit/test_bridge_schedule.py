"""megatron_bridge.schedule's cut of a micro-batch for the LM head that starts at the first loss position: which
position that is, and which keys are cut (every [b, T, ...] tensor) and which are not ([b] tensors, scalars, others).
That the cut step equals the unsharded full step: tests/distributed/test_megatron_policy.py."""
from __future__ import annotations

import torch

from megatron_bridge.schedule import cut_positions, first_loss_position


def micro_batch(b: int = 3, t: int = 7) -> dict:
    mask = torch.zeros(b, t)
    mask[0, 4:6] = 1
    mask[1, 2:7] = 1  # row 1 starts earliest: position 2
    return {"input_ids": torch.arange(b * t).reshape(b, t), "loss_mask": mask,
            "old_logprobs": torch.randn(b, t), "routed_experts": torch.zeros(b, t, 2, 1, dtype=torch.int32),
            "advantages": torch.randn(b), "global_tokens": torch.tensor(7.0), "staleness_tokens": torch.zeros(5),
            "tag": "kept"}


def test_the_first_loss_position_is_the_earliest_over_the_rows():
    mb = micro_batch()
    assert first_loss_position(mb) == 2
    assert first_loss_position({**mb, "loss_mask": torch.zeros(3, 7)}) == 0  # nothing to train: no cut
    assert first_loss_position({"input_ids": mb["input_ids"]}) == 0  # no mask (forward only): no cut


def test_every_b_by_t_tensor_is_cut_and_nothing_else():
    mb = micro_batch()
    cut = cut_positions(mb, 2)
    assert cut["head_from"] == 2
    for key in ("input_ids", "loss_mask", "old_logprobs", "routed_experts"):
        assert torch.equal(cut[key], mb[key][:, 2:]), key
    assert cut["routed_experts"].shape == (3, 5, 2, 1)
    for key in ("advantages", "global_tokens", "staleness_tokens", "tag"):
        assert cut[key] is mb[key], key
    assert cut["loss_mask"].sum() == mb["loss_mask"].sum()  # no loss token is lost
    assert "head_from" not in mb  # the micro-batch itself is untouched
