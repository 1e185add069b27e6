"""`rft explorer` / `rft publish` refuse what they cannot serve, before starting an engine (and every part that joins
a run's broker refuses `embedded`); explorer config checks."""
from __future__ import annotations

import pytest
import yaml

from rft.cli import main as rft
from rft.config import ConfigError
from rft.run.loading import run_config_from_dict


@pytest.fixture
def config(tmp_path):
    def write(**sections):
        raw = {"model": {"path": str(tmp_path)}, **sections}
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(raw))
        return str(path)
    return write


@pytest.mark.parametrize("command", ["explorer", "publish", "trainer", "status", "serve", "joiner", "replay"])
def test_every_part_that_joins_a_broker_refuses_embedded_with_one_message(config, tmp_path, capsys, command):
    """rft.cli.commandline.require_broker: exit 2, the part named, the fix given, before anything starts."""
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')  # `rft replay` checks the model
    with pytest.raises(SystemExit) as exit_info:
        rft([command, config(run={"output_dir": str(tmp_path / "runs")})])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith(f"rft {command}: kafka.bootstrap_servers is 'embedded'"), err
    assert f"rft {command} joins a running broker: pass --set kafka.bootstrap_servers=HOST:PORT" in err
    assert "the config.yaml that `rft run` wrote to its run directory" in err


def test_the_refusal_names_the_config_rft_run_wrote_when_there_is_one(config, tmp_path, capsys):
    written = tmp_path / "runs" / "rft-run" / "config.yaml"
    written.parent.mkdir(parents=True)
    written.write_text("kafka: {bootstrap_servers: 127.0.0.1:9092}\n")
    with pytest.raises(SystemExit):
        rft(["status", config(run={"output_dir": str(tmp_path / "runs")})])
    assert f"or {written}, the config `rft run` wrote (it names its broker)" in capsys.readouterr().err


def test_explorer_refuses_modes_without_explorers(config, capsys):
    assert rft(["explorer", config(run={"mode": "offline"}, kafka={"bootstrap_servers": "localhost:1"})]) == 2
    assert "run.mode offline runs no explorers" in capsys.readouterr().err


def test_explorer_replicas_must_be_positive(config, capsys):
    assert rft(["explorer", config(kafka={"bootstrap_servers": "localhost:1"}), "--replicas", "0"]) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err


def test_invalid_explorer_config_exits_2_naming_the_key(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        rft(["explorer", config(explorer={"reward": "nope"})])
    assert exit_info.value.code == 2
    assert "explorer.reward: unknown reward 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("explorer,message", [
    ({"max_turns": 0}, "explorer.max_turns: must be >= 1"),
    ({"heartbeat_s": 0}, "explorer.heartbeat_s: must be > 0"),
    ({"max_batch_s": -1}, "explorer.max_batch_s: must be > 0"),
    ({"admission": "stalenes"},
     "explorer.admission: admission import path 'stalenes' must look like package.module:name"),
    ({"admission": "rft.trainer.staleness:nothing"}, "explorer.admission: .*has no callable 'nothing'"),
    ({"engine": "sglang"}, "explorer.engine: must be one of vllm, transformers"),
])
def test_explorer_config_errors(explorer, message):
    with pytest.raises(ConfigError, match=message):
        run_config_from_dict({"model": {"path": "unused"}, "explorer": explorer})
