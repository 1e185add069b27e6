"""torchrun worker for tests/distributed/test_routing_replay.py: the training-inference log-prob mismatch of recorded
MoE rollouts, with and without routing replay, at expert parallelism 2 (world 2: EP 2 over the 2 data-parallel
ranks), then at tensor parallelism 2 (with megatron's sequence parallelism, which MoE at TP > 1 needs).

Usage: torchrun --nproc-per-node 2 _worker_routing_replay.py SPEC.json, SPEC {"out_dir", "moe" (HF directory),
"records": {name: file of msgpack-listed experience-group records}, "train_on": a name}. For each record set, the step's
micro-batches are built as the trainer builds them (rft.trainer.batch, routing=True); `forward_logprobs` scores them
with the recorded routing replayed and, on copies without `routed_experts`, routed by the trainer itself; each gives
logprob_mismatch_mean / _max over both ranks. Then, on `train_on`'s, one `train_step` with replay reports the metrics
itself (they must equal the replayed forward's; EP 2 only). Rank 0 writes `<name>.<layout>.json`, layout ep2 or tp2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from rft.algorithms.mismatch import logprob_mismatch, with_mismatch_metrics
from rft.schema import decode_group
from rft.trainer.batch import plan_micro_batches, replayed_fraction, rows_from_groups


def mismatch(policy, micro_batches) -> dict[str, float]:
    """logprob_mismatch_mean / _max of `forward_logprobs` over this step (both data-parallel ranks)."""
    stats = [logprob_mismatch(lp, mb["old_logprobs"], mb["loss_mask"], normaliser=mb["global_tokens"])
             for lp, mb in zip(policy.forward_logprobs(micro_batches), micro_batches, strict=True)]
    total = torch.stack([sum(s["logprob_mismatch_mean"] for s in stats)])
    largest = torch.stack([max(s["logprob_mismatch_max"] for s in stats)])
    from megatron.core import parallel_state as ps

    dist.all_reduce(total, group=ps.get_data_parallel_group())
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    return {"mean": float(total), "max": float(largest)}


def nll(token_logprobs, mb):
    return -(token_logprobs * mb["loss_mask"]).sum() / mb["global_tokens"], {}


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    score(spec, "ep2", ep=2, train=True)
    score(spec, "tp2", tp=2, train=False)  # sequence parallelism: each TP rank routes its slice of the sequence
    dist.destroy_process_group()


def score(spec: dict, layout: str, *, tp: int = 1, ep: int = 1, train: bool) -> None:
    from megatron_bridge import parallel
    from megatron_bridge.policy import MegatronPolicy

    policy = MegatronPolicy(spec["moe"], tp=tp, ep=ep, lr=1e-4, seed=0, routing_replay=True)
    for name, path in spec["records"].items():
        groups = [decode_group(value) for value in msgpack.unpackb(Path(path).read_bytes())]
        rows = rows_from_groups(groups, [np.zeros(len(g.samples)) for g in groups], routing=True)
        plan = plan_micro_batches(rows, dp_size=policy.layout.dp, micro_batch_size=4)
        replayed = plan.for_rank(policy.layout.dp_rank)
        routed_normally = [{k: v for k, v in mb.items() if not k.startswith("routed_")} for mb in replayed]
        result = {"replay": mismatch(policy, replayed), "no_replay": mismatch(policy, routed_normally),
                  "replayed_fraction": replayed_fraction(rows)}
        if train and name == spec["train_on"]:
            metrics = policy.train_step(replayed, with_mismatch_metrics(nll))
            result["train_step"] = {"mean": metrics["logprob_mismatch_mean"], "max": metrics["logprob_mismatch_max"]}
        if policy.layout.rank == 0:
            (Path(spec["out_dir"]) / f"{name}.{layout}.json").write_text(json.dumps(result, indent=2))
    parallel.destroy(keep_process_group=True)  # the next layout reuses the process group


if __name__ == "__main__":
    main(sys.argv[1])
