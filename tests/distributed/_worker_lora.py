"""torchrun worker for tests/distributed/test_lora.py: LoRA policies at TP=2, PP=2 and DP=2 in one 2-process group.

Usage: torchrun --nproc-per-node 2 _worker_lora.py SPEC.json, SPEC {"out_dir", "model", "adapter"} (an HF model
directory and a PEFT adapter for it with non-zero B, so that every adapter gets a gradient). Every case starts
from that adapter (`model.lora.init_from`) and, with grad_clip 0, takes one optimizer step on the batches of
_worker_policy (token-mean NLL):
- tp2: logprobs of batch 1 before the step -> `tp2.before.safetensors`; the adapters' gradients of the step in
  PEFT layout -> `tp2.grads.safetensors`; after the step: the adapter published to a weight store
  (`tp2.store/v00000001`), its logprobs -> `tp2.after.safetensors`, the reference logprobs (the base: adapters
  switched off) -> `tp2.reference.safetensors`, the merged export -> `tp2.merged.hf`, the checkpoint -> `tp2.ckpt`.
- pp2: gradients -> `pp2.grads.safetensors`; then a fresh PP=2 policy loads `tp2.ckpt` and exports its adapters
  -> `pp2.resumed.safetensors` (must equal the published version 1), and takes a step on batch 2 ->
  `pp2.step2.safetensors`, which must equal tp2's own step on batch 2 after its checkpoint (`tp2.step2.safetensors`):
  the checkpoint carried Adam's state across the layout change.
- dp2: the micro-batches split over two data-parallel replicas -> `dp2.grads.safetensors`.
`<case>.facts.json` (rank 0): trainable elements in megatron's optimizer and in the DDP buffers, and the step's
grad_norm (megatron's global norm over every rank's adapters).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _worker_policy import micro_batches, save_logprobs, shard_for_data_parallel, token_mean_nll  # noqa: E402

RANK, ALPHA = 4, 8.0
# grad_clip: so large that it never clips, but megatron computes the global gradient norm (reported as grad_norm)
HYPERPARAMETERS = dict(lr=1e-2, weight_decay=0.0, grad_clip=1e9, betas=(0.9, 0.95))


def lora_config(adapter: str):
    from rft.models.config import LoraConfig

    return LoraConfig(rank=RANK, alpha=ALPHA, init_from=adapter)


def adapter_tensors(policy, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The policy's adapters (or their gradients, from megatron's main_grad buffers) in PEFT layout, on rank 0."""
    from megatron_bridge.lora import adapter_parameters
    from megatron_bridge.model import unwrap

    saved = {}
    if grads:
        for name, param in adapter_parameters(unwrap(policy.models[0])):
            saved[name] = param.detach().clone()
            param.data.copy_(param.main_grad)
    out = {}
    for bucket in policy.iter_hf_buckets(1 << 30):
        out.update({k: v.detach().clone().contiguous() for k, v in bucket.items()})
    if grads:
        for name, param in adapter_parameters(unwrap(policy.models[0])):
            param.data.copy_(saved[name])
    return out


def save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    if torch.distributed.get_rank() == 0:
        save_file(tensors, str(path))


def facts(policy, name: str, out: Path, grad_norm: float) -> None:
    from megatron_bridge.model import unwrap

    optimizer = sum(p.numel() for group in policy.optimizer.param_groups for p in group["params"])
    ddp = sum(p.numel() for p in unwrap(policy.models[0]).parameters() if hasattr(p, "main_grad"))
    if torch.distributed.get_rank() == 0:
        (out / f"{name}.facts.json").write_text(json.dumps({"optimizer_elements": optimizer, "ddp_elements": ddp,
                                                            "grad_norm": grad_norm}))


def run_case(spec: dict, name: str, *, tp: int, pp: int) -> None:
    from megatron_bridge import parallel
    from megatron_bridge.policy import MegatronPolicy
    from rft.weights.store import WeightStore

    out = Path(spec["out_dir"])
    policy = MegatronPolicy(spec["model"], tp=tp, pp=pp, seed=0, lora=lora_config(spec["adapter"]),
                            reference=name == "tp2", **HYPERPARAMETERS)
    where = policy.layout
    batches = shard_for_data_parallel(micro_batches(1, policy.vocab_size), where.dp_rank, where.dp)
    if name == "tp2":
        save_logprobs(policy.forward_logprobs(batches), out / "tp2.before.safetensors")
    metrics = policy.train_step(batches, token_mean_nll)
    save(adapter_tensors(policy, grads=True), out / f"{name}.grads.safetensors")
    facts(policy, name, out, metrics["grad_norm"])
    if name == "tp2":
        adapters = adapter_tensors(policy)
        if where.rank == 0:
            WeightStore(out / "tp2.store").publish(1, [adapters], hf_dir=None, adapter_config=policy.adapter_config())
        save_logprobs(policy.forward_logprobs(batches), out / "tp2.after.safetensors")
        save_logprobs(policy.reference_logprobs(batches), out / "tp2.reference.safetensors")
        policy.save_hf(out / "tp2.merged.hf")
        policy.save_checkpoint(out / "tp2.ckpt")
        policy.train_step(micro_batches(2, policy.vocab_size), token_mean_nll)
        save(adapter_tensors(policy), out / "tp2.step2.safetensors")
    parallel.destroy(keep_process_group=True)
    if name == "pp2":
        policy = MegatronPolicy(spec["model"], tp=1, pp=2, seed=1, lora=lora_config(""), **HYPERPARAMETERS)
        policy.load_checkpoint(out / "tp2.ckpt")
        save(adapter_tensors(policy), out / "pp2.resumed.safetensors")
        policy.train_step(micro_batches(2, policy.vocab_size), token_mean_nll)
        save(adapter_tensors(policy), out / "pp2.step2.safetensors")
        parallel.destroy(keep_process_group=True)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    run_case(spec, "tp2", tp=2, pp=1)
    run_case(spec, "pp2", tp=1, pp=2)
    run_case(spec, "dp2", tp=1, pp=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
