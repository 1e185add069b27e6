"""torchrun worker for tests/distributed/test_critic.py: MegatronCritic (PPO's value model), 2 processes.

Usage: torchrun --nproc-per-node 2 _worker_critic.py SPEC.json, with SPEC {"out_dir", "qwen"} (an HF model directory,
tied embeddings). Data: _worker_policy.micro_batches(seed=1), with `values` (V_old) and `returns` from
`value_targets` below. Cases, each: values of the batch -> `<case>.values.safetensors`, one critic step on
PPO's value loss -> `<case>.metrics.json` (rank 0) and the value head's gradient -> `<case>.head_grad.safetensors`
(written by global rank 1, which is on the last stage in every layout):
- tp2 (TP=2): also checkpoints after the step -> `tp2.ckpt`, then values after the step -> `tp2.after.safetensors`
  and a second step on seed 2 -> `tp2.step2.json`;
- pp2 (PP=2);
- resumed (PP=2): a fresh critic loads `tp2.ckpt` -> values `resumed.values.safetensors`, then the second step on
  seed 2 -> `resumed.step2.json`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _worker_policy as cases  # noqa: E402

LR = 1e-3
VALUE_CLIP = 0.05


def value_targets(batches: list[dict], values: list[torch.Tensor], seed: int) -> None:
    """Add V_old = values + noise (some tokens clip) and random returns R to each micro-batch, in place."""
    generator = torch.Generator().manual_seed(seed + 100)
    for mb, v in zip(batches, values, strict=True):
        mask = mb["loss_mask"]
        mb["values"] = (v + 0.1 * torch.randn(v.shape, generator=generator)) * mask
        mb["returns"] = torch.randn(v.shape, generator=generator) * mask


def algorithm():
    from rft.algorithms import build_algorithm
    from rft.algorithms.config import AlgorithmConfig

    return build_algorithm(AlgorithmConfig.of(name="ppo", value_clip=VALUE_CLIP))


def save(tensors: dict[str, torch.Tensor], path: Path, *, rank: int = 0) -> None:
    from safetensors.torch import save_file

    if torch.distributed.get_rank() == rank:
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def step(critic, seed: int, out: Path, name: str) -> dict:
    from megatron_bridge.model import unwrap

    batches = cases.micro_batches(seed=seed, vocab_size=critic.info.dims.vocab_size)
    values = critic.values(batches)
    value_targets(batches, values, seed)
    metrics = critic.train_step(batches, algorithm().value_loss_fn)
    if critic.layout.is_last_stage:
        head = unwrap(critic.models[0]).output_layer
        save({"weight": head.weight.main_grad.float().cpu(), "bias": head.bias.main_grad.float().cpu()},
             out / f"{name}.head_grad.safetensors", rank=1)
    return {"values": values, "metrics": metrics}


def run_case(spec: dict, *, name: str, tp: int, pp: int, load: str | None = None) -> None:
    from megatron_bridge import parallel
    from megatron_bridge.critic import MegatronCritic

    out = Path(spec["out_dir"])
    parallel.initialize(tp, pp, seed=0)
    critic = MegatronCritic(spec["qwen"], lr=LR, grad_clip=1.0)
    if load:
        critic.load_checkpoint(out / load)
        batches = cases.micro_batches(seed=1, vocab_size=critic.info.dims.vocab_size)
        save({f"mb{i}": v for i, v in enumerate(critic.values(batches))}, out / f"{name}.values.safetensors")
    else:
        first = step(critic, 1, out, name)
        save({f"mb{i}": v for i, v in enumerate(first["values"])}, out / f"{name}.values.safetensors")
        if torch.distributed.get_rank() == 0:
            (out / f"{name}.metrics.json").write_text(json.dumps(first["metrics"]))
    if name == "tp2":
        critic.save_checkpoint(out / "tp2.ckpt")
        batches = cases.micro_batches(seed=1, vocab_size=critic.info.dims.vocab_size)
        save({f"mb{i}": v for i, v in enumerate(critic.values(batches))}, out / "tp2.after.safetensors")
    if name in ("tp2", "resumed"):
        second = step(critic, 2, out, f"{name}.step2")
        if torch.distributed.get_rank() == 0:
            (out / f"{name}.step2.json").write_text(json.dumps({**second["metrics"], "steps": critic.steps}))
    parallel.destroy(keep_process_group=True)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    run_case(spec, name="tp2", tp=2, pp=1)
    run_case(spec, name="pp2", tp=1, pp=2)
    run_case(spec, name="resumed", tp=1, pp=2, load="tp2.ckpt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
