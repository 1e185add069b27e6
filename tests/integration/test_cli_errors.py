"""Bad input and a bad environment get one clear line and an exit status, before anything starts (rft.cli: 2 bad
input, 4 broker unreachable): real subprocesses `python -m rft.cli ...`, a real unreachable port, real missing
paths; `rft run` names a failed part's own exception (rft.cli.parts.failure_line)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rft.cli.parts import PartRunner, failure_line
from rft.processes import free_port

REPO = Path(__file__).resolve().parents[2]


def unreachable_address() -> str:
    """127.0.0.1:PORT where nothing listens (a port just released)."""
    return f"127.0.0.1:{free_port()}"


def rft(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rft.cli", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def one_line(done: subprocess.CompletedProcess, status: int, *words: str) -> str:
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


@pytest.fixture
def model(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 4,
                                               "num_key_value_heads": 2, "num_hidden_layers": 2}))
    return d


@pytest.fixture
def config(tmp_path, model) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": str(model)}, "run": {"output_dir": str(tmp_path / "runs")},
                                    "data": {"format": "generated", "path": "copy_char"}}))
    return path


def test_a_missing_config_file(tmp_path):
    for command in ("validate", "run", "status"):
        one_line(rft(command, str(tmp_path / "missing.yaml")), 2, "missing.yaml", "cannot read config file")


@pytest.mark.parametrize("override, words", [
    ("trainer.lrr=1", ["trainer.lrr: unknown key", "did you mean 'lr'"]),
    ("trainer.lr=fast", ["trainer.lr: expected float"]),
    ("trainer.tensor_parallel=3", ["trainer.tensor_parallel: 3 does not divide the model's 4 attention heads"]),
    ("trainer.pipeline_parallel=4", ["trainer.pipeline_parallel: 4 does not divide the model's 2 layers"]),
])
def test_a_bad_set_key_or_value(config, override, words):
    one_line(rft("validate", str(config), "--set", override), 2, str(config), *words)


def test_a_missing_or_unsupported_model_is_refused_before_anything_starts(tmp_path, config, model):
    started = time.monotonic()
    one_line(rft("run", str(config), "--set", f"model.path={tmp_path / 'nonexistent'}"), 2,
             "model.path:", "nonexistent does not exist")
    assert time.monotonic() - started < 30 and not (tmp_path / "runs").exists()  # nothing started
    one_line(rft("validate", str(config), "--set", f"model.path={tmp_path}"), 2,
             "model.path:", "has no config.json")
    (model / "config.json").write_text(json.dumps({"architectures": ["GemmaForCausalLM"], "num_hidden_layers": 2}))
    one_line(rft("validate", str(config)), 2, "GemmaForCausalLM", "the trainer supports", "Qwen2ForCausalLM")


def test_an_unreachable_broker_is_one_line_and_exit_4_from_every_command(config):
    address = unreachable_address()
    for args in (["topics", "list", "--bootstrap", address],
                 ["status", str(config), "--set", f"kafka.bootstrap_servers={address}"],
                 ["publish", str(config), "--set", f"kafka.bootstrap_servers={address}"],
                 ["replay", str(config), "--set", f"kafka.bootstrap_servers={address}", "--set", "algorithm.name=sft"],
                 ["explorer", str(config), "--set", f"kafka.bootstrap_servers={address}"]):  # before its engine
        started = time.monotonic()
        one_line_or_banner = rft(*args)
        assert time.monotonic() - started < 20, args  # a TCP probe, not kafka-python's 20 s wait
        assert one_line_or_banner.returncode == 4, (args, one_line_or_banner.stderr)
        assert "Traceback" not in one_line_or_banner.stderr
        assert f"cannot reach the Kafka broker at {address}" in one_line_or_banner.stderr, args


def test_debug_shows_the_traceback():
    address = unreachable_address()
    assert "Traceback" in rft("--debug", "topics", "list", "--bootstrap", address).stderr
    done = rft("topics", "list", "--bootstrap", address, env={"RFT_DEBUG": "1"})
    assert "BrokerUnreachable" in done.stderr and "Traceback" in done.stderr


TORCHRUN_LOG = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "rft/trainer/main.py", line 61, in main
[rank0]: ValueError: trainer.micro_batch_size 3 does not divide the batch
E1122 18:00:00.000000 1 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
  File "torch/distributed/run.py", line 892, in main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
rft.trainer.main FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================"""


def test_the_failure_line_is_the_parts_own_exception_not_torchruns_banner():
    assert failure_line(TORCHRUN_LOG.splitlines()) == "ValueError: trainer.micro_batch_size 3 does not divide the batch"
    assert failure_line(["starting", "rft.transport.base.BrokerUnreachable: cannot reach it"]) == \
        "rft.transport.base.BrokerUnreachable: cannot reach it"
    assert failure_line(["all good", "exiting"]) is None


def test_rft_run_reports_a_failed_parts_exception(tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    runner = PartRunner(tmp_path)
    try:
        runner.start("trainer", [sys.executable, "-c", "raise ValueError('the real reason')"])
        assert runner.supervise("trainer", essential=set(), poll_s=0.1) == 1
    finally:
        runner.stop_all(grace_s=5)
    assert "[rft] trainer failed: ValueError: the real reason" in capsys.readouterr().err


def test_the_probe_accepts_any_listening_server_and_names_each_failure():
    from rft.transport import BrokerUnreachable, probe_bootstrap

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        probe_bootstrap(f"{unreachable_address()},PLAINTEXT://127.0.0.1:{port}")
    down = unreachable_address()
    with pytest.raises(BrokerUnreachable) as info:
        probe_bootstrap(f"{down},nohost.invalid:9092,bad")
    assert f"cannot reach the Kafka broker at {down}" in str(info.value)
    assert "bad: not host:port" in str(info.value) and "nohost.invalid:9092:" in str(info.value)
