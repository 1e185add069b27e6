"""megatron_bridge.shared_prompts.layout: the shared sequence of a micro-batch, its attention mask against the rule
written out token by token, where the logits go, and when it declines (no shared prompt; responses so long that the
padded rows cost less). The forward itself is checked against the padded step in
tests/distributed/test_shared_prompts.py."""
from __future__ import annotations

import torch

from megatron_bridge.shared_prompts import Costs, layout

SMOLLM2 = Costs(per_position=2.0 * 135e6, per_pair=4.0 * 64 * 9 * 30)  # its parameters; head dim x heads x layers


def micro_batch(rows: list[list[int]], prompt_lens: list[int], width: int | None = None) -> dict[str, torch.Tensor]:
    """Batch-contract inputs of `rows` (each prompt + response tokens; inputs are all but the last), right-padded."""
    width = width or max(len(r) - 1 for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r) - 1] = torch.tensor(r[:-1])
    return {"input_ids": ids, "row_lens": torch.tensor([len(r) - 1 for r in rows]),
            "prompt_lens": torch.tensor(prompt_lens)}


def test_a_shared_prompt_runs_once_and_each_token_sees_what_its_row_showed_it():
    prompt = [5, 6, 7]
    rows = [prompt + [10, 11, 12], prompt + [20], prompt + [30, 31], [8, 9, 40, 41]]  # the last: another prompt
    mb = micro_batch(rows, [3, 3, 3, 2])
    plan = layout(mb, first=1, costs=SMOLLM2)
    # group 1: the prompt once, then row 0's inputs 10 11, row 1's (none: one response token), row 2's 30
    # group 2 (row 3 alone): 8 9 40
    assert plan.input_ids[0].tolist() == [5, 6, 7, 10, 11, 30, 8, 9, 40]
    assert plan.positions[0].tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2]
    owner = [None, None, None, 0, 0, 2, None, None, 3]  # None: a group's prompt
    group = [0, 0, 0, 0, 0, 0, 1, 1, 1]
    for q in range(9):
        for k in range(9):
            sees = group[q] == group[k] and plan.positions[0, k] <= plan.positions[0, q] and \
                (owner[k] is None or owner[k] == owner[q])
            assert bool(plan.blocked[0, 0, q, k]) == (not sees), (q, k)
    # logits from cut column 1: row 0 predicts at its positions 2 (the prompt's last), 3, 4; row 1 at 2; row 2 at
    # 2, 3; row 3 (prompt 2) at 1, 2
    got = sorted(zip(plan.rows.tolist(), plan.columns.tolist(), plan.heads.tolist(), strict=True))
    assert got == [(0, 1, 2), (0, 2, 3), (0, 3, 4), (1, 1, 2), (2, 1, 2), (2, 2, 5), (3, 0, 7), (3, 1, 8)]


def test_no_shared_prompt_no_layout():
    assert layout(micro_batch([[1, 2, 3, 4], [5, 6, 7, 8]], [2, 2]), first=1, costs=SMOLLM2) is None


def test_padding_rows_are_left_out():
    mb = micro_batch([[1, 2, 3, 4], [1, 2, 5, 6], [0]], [2, 2, 0])  # the last: a padding row (row_len 0)
    plan = layout(mb, first=1, costs=SMOLLM2)
    assert plan.input_ids[0].tolist() == [1, 2, 3, 5] and set(plan.rows.tolist()) == {0, 1}


def test_long_responses_run_padded():
    """8 rows of a 100-token prompt: with 20-token responses the shared sequence is far cheaper; with 4,000-token
    responses its attention over ~32,000 positions costs more than the 8 padded rows' and it declines."""
    def rows(response: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.ones(8, 100 + response - 1, dtype=torch.int64),
                "row_lens": torch.full((8,), 100 + response - 1), "prompt_lens": torch.full((8,), 100)}

    assert layout(rows(20), first=99, costs=SMOLLM2) is not None
    assert layout(rows(4000), first=99, costs=SMOLLM2) is None
