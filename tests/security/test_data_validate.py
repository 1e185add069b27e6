"""`rft validate` refuses every class of out-of-range number, by the range each numeric key declares beside itself
(`rft.config.option(..., range=...)`), and reports malformed YAML in one line naming file:line."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing

import pytest

from rft.cli.validate import main as validate_main
from rft.config.fields import RANGE, is_numeric
from rft.run.config import Config, load_config


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 4,
                                               "num_key_value_heads": 2, "num_hidden_layers": 2}))
    return d


def _validate(tmp_path, model_dir, body: str) -> subprocess.CompletedProcess:
    path = tmp_path / "run.yaml"
    path.write_text(f"model:\n  path: {model_dir}\n" + body)
    return subprocess.run([sys.executable, "-m", "rft.cli", "validate", str(path)], capture_output=True, text=True,
                          timeout=120)


BAD = [  # (class of bad value, YAML, the key named, what the message says)
    ("infinite", "explorer:\n  temperature: .inf\n", "explorer.temperature", "finite"),
    ("NaN", "trainer:\n  grad_clip: .nan\n", "trainer.grad_clip", "finite"),
    ("overflowing literal", "trainer:\n  lr: 1e400\n", "trainer.lr", "finite"),
    ("beta outside [0, 1)", "trainer:\n  adam_beta1: 7\n", "trainer.adam_beta1", "in [0, 1)"),
    ("beta of 1", "trainer:\n  adam_beta2: 1.0\n", "trainer.adam_beta2", "in [0, 1)"),
    ("negative timeout", "kafka:\n  request_timeout_ms: -5\n", "kafka.request_timeout_ms", "> 0"),
    ("zero duration", "sync:\n  timeout_s: 0\n", "sync.timeout_s", "> 0"),
    ("port out of range", "monitor:\n  prometheus_port: 70000\n", "monitor.prometheus_port", "[0, 65535]"),
    ("negative port", "sync:\n  push_port: -1\n", "sync.push_port", "[0, 65535]"),
    ("probability over 1", "eval:\n  correct_threshold: 1.5\n", "eval.correct_threshold", "in [0, 1]"),
    ("count of zero", "run:\n  groups_per_step: 0\n", "run.groups_per_step", ">= 1"),
    ("negative weight decay", "trainer:\n  weight_decay: -0.1\n", "trainer.weight_decay", ">= 0"),
    ("list item", "eval:\n  sets:\n  - {name: a, path: p, generated_tasks: 0}\n", "eval.sets[0].generated_tasks",
     ">= 1"),
    ("empty reward range", "run:\n  reward_min: 1\n  reward_max: 1\n", "run.reward_min", "<"),
    ("algorithm option", "algorithm:\n  name: grpo\n  clip_eps: .nan\n", "algorithm.clip_eps", "finite"),
    ("absurd fleet", "explorer:\n  replicas: 1000000\n", "explorer.replicas", "in [0, 1024]"),
    ("absurd prompt length", "  max_prompt_len: 1000000000000\n", "model.max_prompt_len", "in [1, 1e+07]"),
    ("absurd response length", "  max_response_len: 100000000\n", "model.max_response_len", "in [1, 1e+07]"),
    ("plain-http weight store beyond loopback",
     "sync:\n  weight_store: s3://weights/r\n  s3_endpoint: http://minio.example:9000\n", "sync.s3_endpoint",
     "sync.s3_allow_http"),
    ("plain-http claim store beyond loopback",
     "records:\n  store: s3://claims/r\n  s3_endpoint: http://10.0.0.7:9000\n", "records.s3_endpoint",
     "sync.s3_allow_http"),
]


@pytest.mark.parametrize("what,body,key,says", BAD, ids=[b[0] for b in BAD])
def test_validate_refuses_each_class_of_bad_number(tmp_path, model_dir, capsys, what, body, key, says):
    """`rft validate`'s own main, in this process (the command's exit path, as a subprocess, is the malformed-YAML
    test's below and tests/unit/test_config.py's): exit 2 and the key named on stderr."""
    path = tmp_path / "run.yaml"
    path.write_text(f"model:\n  path: {model_dir}\n" + body)
    with pytest.raises(SystemExit) as exited:
        validate_main([str(path)])
    stderr = capsys.readouterr().err
    assert exited.value.code == 2, (what, stderr)
    assert f"{key}: " in stderr and says in stderr, stderr


@pytest.mark.parametrize("endpoint,allow", [("http://127.0.0.1:9000", False), ("http://localhost:9000/", False),
                                            ("http://[::1]:9000", False), ("https://minio.example:9000", False),
                                            ("http://minio.example:9000", True)])
def test_plain_http_s3_endpoints_are_taken_on_loopback_or_when_allowed(model_dir, endpoint, allow):
    """What the plain-http refusals above leave open: loopback, https anywhere, and the explicit opt-in."""
    cfg = load_config(None, [f"model.path={model_dir}", "sync.weight_store=s3://weights/r",
                             f"sync.s3_endpoint={endpoint}", f"sync.s3_allow_http={str(allow).lower()}",
                             "records.store=s3://claims/r", f"records.s3_endpoint={endpoint}"])
    assert cfg.sync.s3_endpoint == cfg.records.s3_endpoint == endpoint


def test_malformed_yaml_is_one_line_naming_file_and_line(tmp_path, model_dir):
    result = _validate(tmp_path, model_dir, "trainer:\n  lr: [1e-5\n  grad_clip: 1\n")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"{tmp_path / 'run.yaml'}:" in lines[0] and "not valid YAML" in lines[0], lines[0]
    line_number = int(lines[0].split(f"{tmp_path / 'run.yaml'}:")[1].split(":")[0])
    assert 3 <= line_number <= 5, lines[0]  # the unclosed list, or the line where the parser gave up on it


def test_every_numeric_key_declares_its_range():
    """A new int / float key must say its range in its field's metadata (`option(..., range=...)`)."""
    missing: list[str] = []

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp, args = hints[f.name], typing.get_args(hints[f.name])
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            elif typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
                walk(args[0], f"{prefix}{f.name}[].")
            elif is_numeric(tp) and f.metadata.get(RANGE) is None:
                missing.append(f"{prefix}{f.name}")

    walk(Config, "")
    assert missing == [], "numeric keys without a declared range (option(..., range=...))"


def test_defaults_and_shipped_ranges_hold(tmp_path, model_dir):
    cfg = load_config(None, [f"model.path={model_dir}"])
    assert cfg.trainer.adam_beta2 == 0.999
