"""Fixtures of the unit tests."""
from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A model directory with only a config.json: enough for the architecture and parallel-size checks."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 4,
                                               "num_key_value_heads": 2,
                                               "num_hidden_layers": 2}))
    return d
