"""torchrun worker (2 processes, gloo) for tests/distributed/test_moe.py: train mixtures of experts with expert
parallelism, checkpoint at one layout, load at others.

Cases, in order (world size 2):
- q3_ep2: Qwen3-MoE at tp1 pp1 ep2 (dp 2, the experts split over both ranks), load-balancing and z-loss on:
  log-probs of batch 1 before training (`q3_ep2.before.safetensors`), steps on batches 1 and 2 (metrics), then
  `q3_ep2.hf` and checkpoint `q3_ep2.ckpt`, and log-probs of batch 3 (`q3_ep2.after.safetensors`).
- q3_tp2 (tp2: sequence parallelism, experts split over TP) and q3_pp2 (pp2, ep1): load `q3_ep2.ckpt`, export
  `<case>.hf`, log-probs of batch 3.
- q3_tp2_fresh: the same steps as q3_ep2 from the same model at tp2 (metrics only).
- q2_pp2: Qwen2-MoE (shared expert) at pp2, one step on batch 1, `q2_pp2.hf`, checkpoint; q2_ep2: load it at
  ep2, export `q2_ep2.hf`.
Metrics go to `<case>.metrics.json` (rank 0). The test holds the assertions.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _worker_policy import HYPERPARAMETERS, save_logprobs, shard_for_data_parallel, token_mean_nll  # noqa: E402
from _worker_policy import micro_batches as policy_micro_batches  # noqa: E402

COEFFICIENTS = dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


def run_case(spec: dict, *, name: str, model: str, tp: int = 1, pp: int = 1, ep: int = 1, steps=(), load=None,
             before: bool = False, after: bool = False, save: bool = False) -> None:
    from megatron_bridge import parallel
    from megatron_bridge.policy import MegatronPolicy

    out = Path(spec["out_dir"])
    policy = MegatronPolicy(spec[model], tp=tp, pp=pp, ep=ep, seed=0, **HYPERPARAMETERS, **COEFFICIENTS)
    where = policy.layout

    def batches(seed):
        return shard_for_data_parallel(policy_micro_batches(seed, policy.vocab_size), where.dp_rank, where.dp)

    if load:
        policy.load_checkpoint(out / load)
    if before:
        save_logprobs(policy.forward_logprobs(batches(1)), out / f"{name}.before.safetensors")
    metrics = {f"step{step}": policy.train_step(batches(step), token_mean_nll) for step in steps}
    policy.save_hf(out / f"{name}.hf")
    if save:
        policy.save_checkpoint(out / f"{name}.ckpt")
    if after:
        save_logprobs(policy.forward_logprobs(batches(3)), out / f"{name}.after.safetensors")
    if where.rank == 0:
        (out / f"{name}.metrics.json").write_text(json.dumps(
            {"rank0": metrics, "layout": [where.tp, where.pp, where.dp, where.ep], "describe": policy.describe()}))
    parallel.destroy(keep_process_group=True)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    run_case(spec, name="q3_ep2", model="qwen3_moe", ep=2, steps=[1, 2], before=True, after=True, save=True)
    run_case(spec, name="q3_tp2", model="qwen3_moe", tp=2, load="q3_ep2.ckpt", after=True)
    run_case(spec, name="q3_pp2", model="qwen3_moe", pp=2, load="q3_ep2.ckpt", after=True)
    run_case(spec, name="q3_tp2_fresh", model="qwen3_moe", tp=2, steps=[1, 2])
    run_case(spec, name="q2_pp2", model="qwen2_moe", pp=2, steps=[1], save=True)
    run_case(spec, name="q2_ep2", model="qwen2_moe", ep=2, load="q2_pp2.ckpt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
