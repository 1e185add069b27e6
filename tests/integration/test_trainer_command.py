"""`rft trainer` started as one process (no torchrun, a bare environment) refuses a layout or a feature this machine
cannot run, with exit 2 and the key, before any model is loaded (the checks themselves:
tests/unit/test_trainer_batch.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


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


def test_pack_sequences_is_refused_without_transformer_engine(tmp_path):
    """This CPU machine has no Transformer Engine: the trainer exits 2 naming the key, before loading a model."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"run": {"name": "pack-check", "mode": "train", "output_dir": str(tmp_path)},
                                      "model": {"path": str(tmp_path / "no-model")},
                                      "kafka": {"bootstrap_servers": "127.0.0.1:1"},
                                      "trainer": {"pack_sequences": True}}))
    result = subprocess.run([sys.executable, "-m", "rft.cli", "trainer", str(config)], cwd=REPO,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "trainer.pack_sequences: needs Transformer Engine on a GPU" in result.stderr
