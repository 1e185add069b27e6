"""torchrun worker for tests/distributed/test_token_budget_batches.py: one MegatronPolicy optimizer step on the same
variable-length rows, micro-batched two ways, at data-parallel size 2 (world size 2, tp = pp = 1).

Usage: torchrun --nproc-per-node 2 _worker_packing.py HF_DIR OUT_DIR. Cases, each a fresh policy from HF_DIR:
- padded: today's fixed shape, `PADDED_MICRO_BATCH_SIZE` rows per micro-batch, every one padded to the step's
  longest row;
- budget: `trainer.max_tokens_per_micro_batch` = `BUDGET`, rows grouped by length.
For each, rank 0 writes `<case>.metrics.json` (train_step's metrics, the plan's padding fraction and micro-batch
shapes per rank) and `<case>.grads.safetensors` (every parameter's gradient after the data-parallel reduction, by
megatron name). The rows and the loss function are imported by the test, which computes the unpadded reference.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from rft.algorithms import build_algorithm
from rft.algorithms.aggregation import with_kl_metric
from rft.algorithms.config import AlgorithmConfig
from rft.schema import ExperienceGroup, Sample
from rft.trainer.batch import Row, plan_micro_batches, rows_from_groups

HYPERPARAMETERS = dict(lr=1e-3, weight_decay=0.0, grad_clip=1e6, betas=(0.9, 0.95))  # no clipping: raw gradients
GROUPS, SAMPLES, VOCAB = 4, 4, 101
PADDED_MICRO_BATCH_SIZE, BUDGET = 4, 48
ALGORITHM = AlgorithmConfig.of(name="grpo", loss_agg="seq_mean")  # seq_mean: global_sequences matters too


def step_rows() -> list[Row]:
    """16 rows of 5 to 33 tokens (prompt 2-6, response 3-27), GRPO advantages, behaviour log-probs near the
    model's."""
    rng = np.random.default_rng(7)
    groups = []
    for g in range(GROUPS):
        prompt = rng.integers(3, VOCAB, rng.integers(2, 7)).astype(np.int32)
        samples = []
        for j in range(SAMPLES):
            n = int(rng.integers(3, 28))
            samples.append(Sample(sample_index=j, prompt_tokens=prompt,
                                  response_tokens=rng.integers(3, VOCAB, n).astype(np.int32),
                                  logprobs=(-4.6 + 0.1 * rng.standard_normal(n)).astype(np.float32),
                                  loss_mask=(rng.random(n) > 0.1).astype(np.uint8), reward=float(rng.random())))
        groups.append(ExperienceGroup(run_id="r", task_id=f"t{g}", group_id=f"g{g}", attempt=0, explorer_id="e",
                                      policy_version=0, samples=samples))
    algorithm = build_algorithm(ALGORITHM)
    return rows_from_groups(groups, algorithm.advantages([g.rewards for g in groups]))


def loss_fn():
    return with_kl_metric(build_algorithm(ALGORITHM).loss_fn)


def run_case(hf_dir: str, out: Path, *, name: str, budget: int) -> None:
    from safetensors.torch import save_file

    from megatron_bridge import parallel
    from megatron_bridge.policy import MegatronPolicy

    policy = MegatronPolicy(hf_dir, seed=0, **HYPERPARAMETERS)
    where = policy.layout
    plan = plan_micro_batches(step_rows(), dp_size=where.dp, micro_batch_size=PADDED_MICRO_BATCH_SIZE,
                              max_tokens_per_micro_batch=budget)
    metrics = policy.train_step(plan.for_rank(where.dp_rank), loss_fn())
    if where.rank == 0:
        grads = {n: p.main_grad.detach().clone().contiguous() for n, p in policy.models[0].named_parameters()}
        save_file(grads, out / f"{name}.grads.safetensors")
        shapes = [[[b, t] for _, b, t in rank] for rank in plan.ranks]
        (out / f"{name}.metrics.json").write_text(json.dumps({"metrics": metrics, "shapes": shapes,
                                                              "padding_fraction": plan.padding_fraction}))
    parallel.destroy(keep_process_group=True)


def main() -> None:
    hf_dir, out = sys.argv[1], Path(sys.argv[2])
    torch.use_deterministic_algorithms(True)
    run_case(hf_dir, out, name="padded", budget=0)
    run_case(hf_dir, out, name="budget", budget=BUDGET)


if __name__ == "__main__":
    main()
