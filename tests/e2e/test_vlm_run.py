"""A tiny random vision-language model through the whole loop: `rft run` of a tiny Idefics3 (rft.models.tiny_vlm:
SmolVLM's architecture) on easy-VQA image tasks (the wheel's train split), one explorer on the transformers engine,
the Megatron trainer at tensor parallelism 2 under torchrun (gloo), weights through the store, off_policy with
staleness bound 1, the evaluator on the held-out test split at versions 0 and the last. The run's broker is the
session's, so its topics can be read back after it. Checked from what the run left: every step trained groups of
image samples (each sample's prompt ids are exactly the processor's expansion of its `prompt_text` and images), no
trained group was staler than the bound, the train/inference mismatch was logged each step and is at rounding level
where the weights had not changed (staleness 0), the explorer reloaded published versions, the evaluator scored the
held-out image set, and every dead letter carries its reason (here the tasks whose prompt, image tokens counted, is
over model.max_prompt_len: refused whole)."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from benchmarks.runs import consumed, read_topic, steps_done, write_config
from rft.schema import HEADER_ERROR, decode_group
from tests.support.runs import run_to_the_end

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]
STEPS, GROUPS, BOUND, EVAL_TASKS = 3, 2, 1, 8
# model.max_prompt_len: easy-VQA's image prompts here are 25 to 48 tokens (7 of them the image's), so about half the
# tasks are refused whole at the explorer's intake (dead-lettered with the reason, never cut inside an image)
PROMPT_LIMIT = 33


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> Path:
    """The tiny Idefics3 with its processor (a 64 x 64 easy-VQA image -> one 32 x 32 view, 4 image tokens)."""
    from rft.models.tiny_vlm import make_tiny_idefics3
    return make_tiny_idefics3(tmp_path_factory.mktemp("vlm") / "idefics3")


def test_a_tiny_vlm_trains_on_image_tasks_through_the_whole_loop(tmp_path, tiny_vlm, bootstrap, topic_prefix):
    from rft.data.easy_vqa import easy_vqa_rows
    from rft.models.vision import load_processor, placeholder, process_prompt

    held_out = {"name": "vqa", "format": "easy_vqa", "path": "test", "generated_tasks": EVAL_TASKS, "seed": 7,
                "reward": "exact_match"}
    config = write_config(
        tmp_path, tiny_vlm, "vlm",
        run={"mode": "off_policy", "max_staleness": BOUND, "max_steps": STEPS, "groups_per_step": GROUPS},
        kafka={"bootstrap_servers": bootstrap, "topic_prefix": topic_prefix},  # a broker that outlives the run
        explorer={"replicas": 1, "engine": "transformers", "workflow": "single_turn",
                  "reward": "tests.reward_plugins:even_characters",  # exact_match: all 0, no gradient
                  "max_tokens": 4, "tasks_per_batch": 2},
        trainer={"micro_batch_size": 8, "tensor_parallel": 2, "checkpoint_every": 100},
        data={"format": "easy_vqa", "path": "train", "generated_tasks": 64, "epochs": 1},
        eval={"sets": [held_out], "n_samples": 2, "k": 1, "every_steps": STEPS, "max_tokens": 4},
        monitor={"progress": False})
    run_dir = tmp_path / "runs" / "vlm"
    log = tmp_path / "run.log"
    steps = run_to_the_end(config, run_dir, log, STEPS, model={"max_prompt_len": PROMPT_LIMIT, "max_response_len": 4})
    records = steps_done(run_dir)
    for r in steps:
        assert r["staleness_max"] <= BOUND and math.isfinite(r["loss"])
        assert 0 <= r["logprob_mismatch_mean"] <= r["logprob_mismatch_max"] < math.inf
        if "logprob_mismatch_stale0_max" in r:  # tokens sampled by the weights they were trained from
            assert r["logprob_mismatch_stale0_max"] < 1e-3, r
    assert any("logprob_mismatch_stale0_max" in r for r in steps)  # step 1 at least: version 0 trains on version 0
    assert any(r["grad_norm"] > 0 for r in steps)  # the weights the explorer reloads did change

    trained = consumed(run_dir)
    assert sorted({c["step"] for c in trained}) == list(range(1, STEPS + 1)) and len(trained) == STEPS * GROUPS
    assert all(0 <= c["staleness"] <= BOUND for c in trained)
    assert max(c["policy_version"] for c in trained) >= 1  # the explorer sampled with published trained weights
    explorer_log = (run_dir / "logs" / "explorer-0.log").read_text()
    loaded = [int(v) for v in re.findall(r"loaded weights version (\d+)", explorer_log)]
    assert loaded and loaded == sorted(set(loaded)) and loaded[0] >= 1, explorer_log[-3000:]  # versions advance

    groups = {g.group_id: g for g in map(lambda m: decode_group(m.value, m.headers),
                                         read_topic(bootstrap, f"{topic_prefix}.experiences"))}
    processor = load_processor(tiny_vlm)
    for c in trained:
        group = groups[c["group_id"]]
        assert group.policy_version == c["policy_version"]
        for sample in group.samples:
            assert len(sample.images) == 1 and sample.images[0].media_type == "image/png"
            assert sample.prompt_text is not None and sample.prompt_text.count("<image>") == 1
            expanded = process_prompt(processor, sample.prompt_text,
                                      [(i.data, i.media_type) for i in sample.images])
            assert list(sample.prompt_tokens) == expanded.token_ids and expanded.image_tokens > 0
            assert len(sample.prompt_tokens) <= PROMPT_LIMIT

    def prompt_len(row: dict) -> int:
        image = row["images"][0]
        return len(process_prompt(processor, placeholder(processor) + row["prompt"],
                                  [(image.data, image.media_type)]).token_ids)

    too_long = sum(prompt_len(row) > PROMPT_LIMIT for row in easy_vqa_rows("test", seed=7, size=EVAL_TASKS))
    assert 0 < too_long < EVAL_TASKS
    evals = [r for r in records if "eval/checkpoint" in r]
    assert [r["step"] for r in evals] == [0, STEPS], evals
    for r in evals:  # the held-out image set, its prompts over the limit counted as errors (wrong), not cut
        assert r["eval/vqa/tasks"] == EVAL_TASKS and r["eval/vqa/errors"] == too_long
        assert 0.0 <= r["eval/vqa/accuracy"] <= 1.0

    reasons = [dict(letter.headers).get(HEADER_ERROR, b"").decode()
               for letter in read_topic(bootstrap, f"{topic_prefix}.dead_letter")]
    assert all(reasons) and any(f"over model.max_prompt_len {PROMPT_LIMIT}" in r for r in reasons), reasons
