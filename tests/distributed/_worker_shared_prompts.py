"""torchrun worker for tests/distributed/test_shared_prompts.py: the same two GRPO steps trained with the rows run
padded and with shared prompts (megatron_bridge.shared_prompts), at TP=2 (2 processes).

Usage: torchrun --nproc-per-node 2 _worker_shared_prompts.py SPEC.json, SPEC {"out_dir", "qwen", "llama"}. Per model
and setting (`padded`, `shared`): the exported weights after each step (`<model>.<setting>.step<k>.hf`) and, from
rank 0, `<model>.<setting>.json` with each step's metrics, the positions the embedding layer ran per micro-batch
(`embedded`) and the policy's description. The rows (`step_rows`) come from rft.trainer.batch as the trainer builds
them: groups of 4 samples of one prompt (prompt lengths 3, 5 and 7), responses of 1 to 6 tokens, micro-batches of
6 rows, so one micro-batch holds a whole group and part of the next.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

GROUP, MICRO_BATCH_SIZE, LR = 4, 6, 1e-3


def step_rows(seed: int, vocab_size: int) -> list:
    from rft.algorithms import build_algorithm
    from rft.algorithms.config import AlgorithmConfig
    from rft.schema import ExperienceGroup, Sample
    from rft.trainer.batch import rows_from_groups

    rng = np.random.default_rng(seed)
    groups = []
    for g, prompt_len in enumerate((3, 5, 7)):
        prompt = rng.integers(3, vocab_size, prompt_len).astype(np.int32)
        samples = []
        for j in range(GROUP):
            n = 1 if j == 0 else int(rng.integers(2, 7))  # a one-token response has no response input position
            samples.append(Sample(sample_index=j, prompt_tokens=prompt,
                                  response_tokens=rng.integers(3, vocab_size, n).astype(np.int32),
                                  logprobs=rng.uniform(-4, -1, n).astype(np.float32), loss_mask=np.ones(n, np.uint8),
                                  reward=float(j % 2)))
        groups.append(ExperienceGroup(run_id="t", task_id=f"t{g}", group_id=f"g{g}", attempt=0, explorer_id="e",
                                      policy_version=0, samples=samples))
    return rows_from_groups(groups, build_algorithm(AlgorithmConfig()).advantages([g.rewards for g in groups]))


def run(spec: dict, model: str, setting: str) -> None:
    from megatron_bridge import parallel
    from megatron_bridge.model import unwrap
    from megatron_bridge.policy import MegatronPolicy
    from rft.algorithms import build_algorithm
    from rft.algorithms.config import AlgorithmConfig
    from rft.trainer.batch import plan_micro_batches

    out = Path(spec["out_dir"])
    policy = MegatronPolicy(spec[model], tp=2, lr=LR, seed=0, share_prompts=setting == "shared")
    embedded: list[int] = []
    unwrap(policy.models[0]).embedding.register_forward_hook(
        lambda module, args, output: embedded.append(output.shape[0] * output.shape[1]))  # [s, b, h]
    loss_fn = build_algorithm(AlgorithmConfig()).loss_fn
    record = {"describe": policy.describe(), "steps": []}
    for step in (1, 2):
        embedded.clear()
        plan = plan_micro_batches(step_rows(step, policy.vocab_size), dp_size=1, micro_batch_size=MICRO_BATCH_SIZE)
        metrics = policy.train_step(plan.for_rank(0), loss_fn)
        record["steps"].append({"metrics": metrics, "embedded": list(embedded)})
        policy.save_hf(out / f"{model}.{setting}.step{step}.hf")
    if torch.distributed.get_rank() == 0:
        (out / f"{model}.{setting}.json").write_text(json.dumps(record))
    parallel.destroy(keep_process_group=True)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    for model in ("qwen", "llama"):
        for setting in ("padded", "shared"):
            run(spec, model, setting)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
