"""Worker for tests/distributed/test_fp16_loss_scale.py: float16 MegatronPolicy steps with megatron's dynamic loss
scaler, one process (world size 1; started with plain python, parallel.initialize picks a free port).

Usage: python _worker_fp16.py HF_DIR OUT.json INITIAL_LOSS_SCALE STEPS. Every step trains on the same batch
(_worker_policy.micro_batches(seed=1)) with lr 1e-3. For each step it records the loss scale before the step, the
step's `step_skipped` and `grad_norm`, and a checksum of the float32 main weights after it; the test checks them
against the scaler's textbook rule and an unsharded float32 gradient.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _worker_policy as cases  # noqa: E402

from megatron_bridge.policy import MegatronPolicy  # noqa: E402


def main(hf_dir: str, out: str, initial_loss_scale: float, steps: int) -> None:
    policy = MegatronPolicy(hf_dir, seed=0, dtype="float16", initial_loss_scale=initial_loss_scale, lr=1e-3)
    batch = cases.micro_batches(seed=1, vocab_size=policy.vocab_size)
    records = []
    for _ in range(steps):
        scale = float(policy.optimizer.get_loss_scale())
        metrics = policy.train_step(batch, cases.token_mean_nll)
        checksum = sum(float(p.detach().double().abs().sum()) for group in policy.optimizer.param_groups
                       for p in group["params"])
        records.append({"scale": scale, "skipped": metrics["step_skipped"], "grad_norm": metrics["grad_norm"],
                        "loss": metrics["loss"], "main_weights_abs_sum": checksum})
    Path(out).write_text(json.dumps(records))
    policy.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
