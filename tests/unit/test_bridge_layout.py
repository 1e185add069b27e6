"""`rft bridge-check` refuses a layout the model's shape cannot take, in one line and before any process starts
(SmolLM2-135M has 9 attention heads and 3 key/value heads: TP=2 cannot split them, TP=3 can)."""
from __future__ import annotations

import json

import pytest

from megatron_bridge.check import main as check_main
from megatron_bridge.layout import layout_problem


def smollm2_like(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3,
                                                      "num_hidden_layers": 30}))
    return str(tmp_path)


def test_layouts_that_do_not_divide_the_model_are_named(tmp_path):
    model = smollm2_like(tmp_path)
    assert layout_problem(model, tp=3, pp=2) is None
    assert "--tp 2 does not divide the model's 9 attention heads" in layout_problem(model, tp=2, pp=1)
    assert "--tp 9 does not divide the model's 3 key/value heads" in layout_problem(model, tp=9, pp=1)
    assert "--pp 4 does not divide the model's 30 layers" in layout_problem(model, tp=1, pp=4)
    assert "cannot read the model's config" in layout_problem(str(tmp_path / "missing"), tp=1, pp=1)


def test_expert_and_uneven_pipeline_layouts_are_checked(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2,
                                                      "num_hidden_layers": 6, "num_experts": 6}))
    model = str(tmp_path)
    assert layout_problem(model, tp=1, pp=2, ep=2, pp_layers=(1, 5)) is None
    assert "--ep 4 does not divide the model's 6 experts" in layout_problem(model, tp=1, pp=1, ep=4)
    assert "summing to the model's 6 layers" in layout_problem(model, tp=1, pp=2, pp_layers=(1, 2))
    assert "only the first and last stage differ" in layout_problem(model, tp=1, pp=4, pp_layers=(1, 1, 3, 1))


def test_expert_parallelism_of_a_dense_model_is_refused(tmp_path):
    model = smollm2_like(tmp_path)
    assert "--ep 2 for a model without experts" in layout_problem(model, tp=1, pp=1, ep=2)


def test_the_command_refuses_before_starting_workers(tmp_path, capsys):
    """In this process: the unit tier refuses any process start (tests/unit/conftest.py), so the refusal comes first."""
    with pytest.raises(SystemExit) as done:
        check_main([smollm2_like(tmp_path), "--tp", "2"])
    assert done.value.code == 2
    assert "does not divide the model's 9 attention heads" in capsys.readouterr().err
