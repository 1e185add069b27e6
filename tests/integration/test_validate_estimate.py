"""`rft validate` prints the largest experience record its config can produce (rft.run.record_size) and warns when
every group would be dead-lettered as too large: a real `python -m rft.cli validate` on a config file and a Qwen3-MoE
config.json."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def validate(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = [a for o in overrides for a in ("--set", o)]
    return subprocess.run([sys.executable, "-m", "rft.cli", "validate", str(config), *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_validate_prints_the_largest_record_and_warns_before_every_group_is_dead_lettered(tmp_path):
    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 4, "num_experts": 64, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
        "mlp_only_layers": [0]}))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"output_dir": str(tmp_path / "runs"), "routing_replay": True},
        "model": {"path": str(model), "max_prompt_len": 512, "max_response_len": 16384},
        "explorer": {"n_samples": 16, "max_tokens": 16384, "engine": "transformers"},
        "trainer": {"pack_sequences": False},
        "kafka": {"max_record_bytes": 1000000},
        "data": {"format": "generated", "path": "copy_char"}}))
    done = validate(config)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    # 16 x (512 x 4 + 16,384 x (9 + 24)) = 8.68 MB: int32 ids, float32 log-probs, uint8 mask (9 bytes a response
    # token), 3 MoE layers (layer 0 dense) x top-8 x 1 byte a position from P - 1
    assert out[1] == ("largest experience record: 16 samples x 16,896 tokens (512 prompt + 16,384 response): 8.7 MB "
                      "inline (routing 6.3 MB: 3 MoE layers x top-8 x 1 byte a position, from the last prompt "
                      "position)"), done.stdout
    assert out[2].startswith("parts over records.claim_threshold_bytes (131,072) go to the claim store "
                             "(records.store: beside the weights, <run dir>/weights/records): routed_experts: record "
                             "~2.4 MB"), done.stdout
    assert out[3].startswith("still over kafka.max_record_bytes (1,000,000) at 2.4 MB: the body, its parts claimed, "
                             "goes to the claim store"), done.stdout
    never = validate(config, "records.claim_threshold_bytes=0")
    assert never.returncode == 0, never.stderr
    assert never.stdout.splitlines()[-1] == (
        "warning: the largest record (8.7 MB) is over kafka.max_record_bytes (1,000,000) and "
        "records.claim_threshold_bytes is 0: every group will be dead-lettered as too large: set "
        "records.claim_threshold_bytes"), never.stdout
