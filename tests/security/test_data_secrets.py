"""Issue 29, item 5: secrets stay secret. A value that came from `${ENV}` and a value under a key named like a secret
(kafka.security.sasl_plain_password) appear nowhere in the run's config.yaml, `rft validate --print` or the
dashboard's config view; the parts still get them (config.yaml holds references their environment expands); the
run directory is 0700 and config.yaml 0600."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import uuid

import pytest
import yaml

from rft.cli.prepare import make_private_dir, write_run_config
from rft.config.secrets import REDACTED
from rft.dashboard.model import RunWatch
from rft.run.config import load_config
from rft.run.stages import resolve_stages

ENV_SECRET = f"env-{uuid.uuid4().hex}"
WRITTEN_SECRET = "123456"  # written in the YAML itself; digits: it must come back a string


@pytest.fixture
def config(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "num_hidden_layers": 2}))
    monkeypatch.setenv("RFT_TEST_TOKEN", ENV_SECRET)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "run": {"name": "secret-run", "output_dir": str(tmp_path / "runs")},
        "model": {"path": str(model)},
        "kafka": {"security": {"security_protocol": "SASL_SSL", "sasl_plain_username": "${RFT_TEST_TOKEN}",
                               "sasl_plain_password": WRITTEN_SECRET, "ssl_check_hostname": True}},
        "data": {"prompt_key": "question"},
        "stages": [{"name": "one"}, {"name": "two", "trainer": {"lr": 2e-5}}],
    }))
    return path


def test_validate_print_shows_references_and_redactions_never_values(config):
    result = subprocess.run([sys.executable, "-m", "rft.cli", "validate", str(config), "--print"],
                            capture_output=True, text=True, timeout=120, env=os.environ)
    assert result.returncode == 0, result.stderr
    assert ENV_SECRET not in result.stdout and WRITTEN_SECRET not in result.stdout
    security = yaml.safe_load(result.stdout)["kafka"]["security"]
    assert security["sasl_plain_username"] == "${RFT_TEST_TOKEN}" and security["sasl_plain_password"] == REDACTED
    assert security["ssl_check_hostname"] is True  # not a secret
    assert yaml.safe_load(result.stdout)["data"]["prompt_key"] == "question"  # rft's own keys hold no secrets


def test_the_run_config_hides_secrets_yet_gives_them_to_the_parts(config, monkeypatch):
    cfg = load_config(config)
    assert cfg.kafka.security["sasl_plain_username"] == ENV_SECRET  # the loaded config has the values
    monkeypatch.setattr(os, "environ", dict(os.environ))  # write_run_config hands secrets on through it
    old = os.umask(0o077)  # as `rft run` sets it
    try:
        make_private_dir(cfg.run_dir / "logs")
        written = cfg.run_dir / "config.yaml"
        written.write_text("an older file, world-readable")
        os.chmod(written, 0o644)
        write_run_config(cfg, written)
    finally:
        os.umask(old)
    text = written.read_text()
    assert ENV_SECRET not in text and WRITTEN_SECRET not in text
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    assert stat.S_IMODE(cfg.run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((cfg.run_dir / "logs").stat().st_mode) == 0o700

    part = load_config(written)  # what a part started by `rft run` reads, with the environment it inherits
    assert part.kafka.security["sasl_plain_username"] == ENV_SECRET
    assert part.kafka.security["sasl_plain_password"] == WRITTEN_SECRET  # a string, as written
    assert ENV_SECRET not in part.to_yaml() and WRITTEN_SECRET not in part.to_yaml()  # and it keeps them hidden

    shown = RunWatch("secret-run", cfg.run_dir).snapshot()["config"]["yaml"]  # the dashboard `rft run` starts
    assert ENV_SECRET not in shown and WRITTEN_SECRET not in shown and REDACTED in shown
    for name in [n for n in os.environ if n.startswith("RFT_SECRET_")]:
        monkeypatch.delenv(name)
    shown = RunWatch("secret-run", cfg.run_dir).snapshot()["config"]["yaml"]  # one started by hand, without them
    assert ENV_SECRET not in shown and WRITTEN_SECRET not in shown and REDACTED in shown


def test_stage_configs_keep_the_references(config):
    cfg = load_config(config)
    for stage in resolve_stages(cfg):
        text = stage.config.to_yaml()
        assert ENV_SECRET not in text and WRITTEN_SECRET not in text, stage.name
        assert "${RFT_TEST_TOKEN}" in text
