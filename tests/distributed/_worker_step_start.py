"""torchrun worker for tests/distributed/test_step_start.py: MegatronPolicy.step_start (the pass before a step of
`Needs.step_start`) with entropy and the collision term, at TP=2 and at TP=1 (DP=2), on the micro-batches of
_worker_policy.py.

Usage: torchrun --nproc-per-node 2 _worker_step_start.py SPEC.json, with SPEC {"out_dir", "qwen"}. Writes
`<case>.safetensors` (rank 0; tensors `mb<i>.<key>`) for its data-parallel share: all micro-batches at TP=2, the first
half at DP=2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _worker_policy as cases  # noqa: E402


def run_case(spec: dict, name: str, tp: int) -> None:
    from safetensors.torch import save_file

    from megatron_bridge import parallel
    from megatron_bridge.policy import MegatronPolicy

    policy = MegatronPolicy(spec["qwen"], tp=tp, pp=1, seed=0, temperature=0.7, **cases.HYPERPARAMETERS)
    where = policy.layout
    batches = cases.shard_for_data_parallel(cases.micro_batches(1, policy.vocab_size), where.dp_rank, where.dp)
    start = policy.step_start(batches, entropy=True, collision=True)
    if where.rank == 0:
        save_file({f"mb{i}.{k}": v.contiguous() for i, values in enumerate(start) for k, v in values.items()},
                  Path(spec["out_dir"]) / f"{name}.safetensors")
    parallel.destroy(keep_process_group=True)


def main() -> None:
    from megatron_bridge import logprobs

    logprobs.ENTROPY_CHUNK_TOKENS = cases.ENTROPY_CHUNK_TOKENS  # chunks that end inside micro-batches
    spec = json.loads(Path(sys.argv[1]).read_text())
    run_case(spec, "tp2", tp=2)
    run_case(spec, "dp2", tp=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
