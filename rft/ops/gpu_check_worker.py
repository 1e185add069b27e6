"""The processes behind three rows of `python -m rft.ops.gpu_check` (one process each: megatron's parallel state is
per process). Not a command for operators.

  python -m rft.ops.gpu_check_worker train HF_DIR CHECKPOINT_DIR OUT.json
      one bfloat16 MegatronPolicy step on a random batch, a dist-checkpoint save, a reload into a fresh policy;
      reports seconds, loss, grad norm, skipped, how many exported tensors differ after the reload (must be 0);
      then one float32 and one float16 step of fresh policies on the same batch: float16's gradient norm (after
      megatron's dynamic loss scaling) must be float32's
  python -m rft.ops.gpu_check_worker sync HF_DIR STORE_DIR OUT.json
      the pull path's stages at this model's size: gathering the HF buckets, the host copy, the store write, and a
      transformers engine's reload of the stored version; reports seconds and megabytes
  python -m rft.ops.gpu_check_worker shared HF_DIR STEPS OUT.json
      the trainer's step with shared prompts against the padded step on the same rows (the flagship's shape: 32 rows
      in groups of 8 sharing a 35-45-token prompt, 2-8 response tokens; lr 1e-12, so the weights stay put): losses
      and gradient norms of each, and the median seconds per step of STEPS timed steps after a warm-up

They run on CUDA when torch sees a GPU, else on the CPU paths (megatron_bridge.device).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from megatron_bridge import parallel
from megatron_bridge.policy import MegatronPolicy
from rft.algorithms import build_algorithm
from rft.algorithms.config import AlgorithmConfig
from rft.schema import ExperienceGroup, Sample
from rft.trainer.batch import plan_micro_batches, rows_from_groups
from rft.weights.store import WeightStore

DTYPE = "bfloat16"
BUCKET_BYTES = 64 << 20  # sync.bucket_mb's default


def step_rows(rng: np.random.Generator, *, rows: int, vocab: int, prompt_len: tuple[int, int],
              response_len: tuple[int, int], group_size: int = 1):
    """`rows` rows in groups of 8 (the advantages' groups); each run of `group_size` rows shares one prompt. The
    shared-prompts row trains on them, and so does `rft bench micro-batches`."""
    samples = []
    for j in range(rows):
        n = int(rng.integers(response_len[0], response_len[1] + 1))
        if j % group_size == 0:
            prompt = rng.integers(3, vocab, int(rng.integers(prompt_len[0], prompt_len[1] + 1))).astype(np.int32)
        samples.append(Sample(sample_index=j, prompt_tokens=prompt,
                              response_tokens=rng.integers(3, vocab, n).astype(np.int32),
                              logprobs=np.full(n, -5.0, np.float32), loss_mask=np.ones(n, np.uint8),
                              reward=float(rng.random())))
    groups = [ExperienceGroup(run_id="bench", task_id=f"t{i}", group_id=f"g{i}", attempt=0, explorer_id="e",
                              policy_version=0, samples=samples[i:i + 8]) for i in range(0, rows, 8)]
    return rows_from_groups(groups, build_algorithm(AlgorithmConfig()).advantages([g.rewards for g in groups]))


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    _synchronize()
    started = time.monotonic()
    result = fn()
    _synchronize()
    return result, time.monotonic() - started


def _micro_batches(vocab_size: int, *, count: int = 2, rows: int = 4, length: int = 64) -> list[dict]:
    """Batch-contract micro-batches of random tokens, the loss on every position but the first 8 (the prompt)."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        tokens = torch.randint(3, vocab_size, (rows, length + 1), generator=generator)
        mask = torch.ones(rows, length)
        mask[:, :8] = 0
        batches.append({"input_ids": tokens[:, :-1].contiguous(), "target_ids": tokens[:, 1:].contiguous(),
                        "position_ids": torch.arange(length).expand(rows, -1).contiguous(), "loss_mask": mask})
    total = torch.stack([b["loss_mask"].sum() for b in batches]).sum()
    for b in batches:
        b["global_tokens"] = total.clone()
    return batches


def _nll(token_logprobs: torch.Tensor, mb: dict):
    mask = mb["loss_mask"].to(token_logprobs.device)
    return -(token_logprobs * mask).sum() / mb["global_tokens"].to(token_logprobs.device), {}


def _exported(policy: MegatronPolicy) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", copy=True) for bucket in policy.iter_hf_buckets(BUCKET_BYTES)
            for name, t in bucket.items()}


def train(hf_dir: str, checkpoint_dir: str, out: str) -> None:
    policy = MegatronPolicy(hf_dir, dtype=DTYPE, lr=1e-5, seed=0)
    batches = _micro_batches(policy.vocab_size)
    metrics, step_s = _timed(lambda: policy.train_step(batches, _nll))
    saved = _exported(policy)
    _, save_s = _timed(lambda: policy.save_checkpoint(checkpoint_dir))
    distributed = policy.distributed_optimizer
    parallel.destroy(keep_process_group=True)
    fresh = MegatronPolicy(hf_dir, dtype=DTYPE, lr=1e-5, seed=0)
    _, load_s = _timed(lambda: fresh.load_checkpoint(checkpoint_dir))
    reloaded = _exported(fresh)
    mismatched = sum(1 for name, t in saved.items() if name not in reloaded or not torch.equal(t, reloaded[name]))
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    parallel.destroy(keep_process_group=True)
    grad_norms = {}
    for dtype in ("float32", "float16"):
        policy = MegatronPolicy(hf_dir, dtype=dtype, lr=1e-5, seed=0)
        scale = float(policy.optimizer.get_loss_scale())
        step = policy.train_step(batches, _nll)
        grad_norms[dtype] = {"grad_norm": step["grad_norm"], "skipped": bool(step["step_skipped"]), "scale": scale}
        parallel.destroy(keep_process_group=True)
    Path(out).write_text(json.dumps({
        "model": Path(hf_dir).name, "step_s": step_s, "save_s": save_s, "load_s": load_s, "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"], "skipped": bool(metrics["step_skipped"]),
        "finite": bool(torch.isfinite(torch.tensor(metrics["loss"]))), "mismatched": mismatched + len(
            set(reloaded) - set(saved)), "distributed_optimizer": distributed, "peak_gib": peak,
        "float16": grad_norms}))
    parallel.destroy()


def sync(hf_dir: str, store_dir: str, out: str) -> None:
    from rft.engine import TransformersEngine  # heavy: transformers

    policy = MegatronPolicy(hf_dir, dtype=DTYPE, lr=1e-5, seed=0)
    list(policy.iter_hf_buckets(BUCKET_BYTES))  # warm-up: first CUDA calls, allocator
    buckets, gather_s = _timed(lambda: list(policy.iter_hf_buckets(BUCKET_BYTES)))
    copies, host_copy_s = _timed(lambda: [{k: v.detach().to("cpu", copy=True) for k, v in b.items()}
                                          for b in buckets])
    megabytes = sum(t.numel() * t.element_size() for b in copies for t in b.values()) / 1e6
    store = WeightStore(store_dir)
    path, write_s = _timed(lambda: store.publish(1, copies, hf_dir=hf_dir))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = TransformersEngine(hf_dir, dtype=DTYPE, device=device)
    _, reload_s = _timed(lambda: engine.load_weights(path, 1))
    Path(out).write_text(json.dumps({
        "model": Path(hf_dir).name, "dtype": DTYPE, "megabytes": megabytes, "gather_s": gather_s,
        "host_copy_s": host_copy_s, "write_s": write_s, "reload_s": reload_s, "engine_device": device}))
    policy.close()


def shared(hf_dir: str, steps: str, out: str) -> None:
    dtype = DTYPE if torch.cuda.is_available() else "float32"
    policy = MegatronPolicy(hf_dir, dtype=dtype, lr=1e-12, seed=0, share_prompts=True)
    active = policy.share_prompts
    rows = step_rows(np.random.default_rng(0), rows=32, vocab=policy.vocab_size, prompt_len=(35, 45),
                     response_len=(2, 8), group_size=8)
    batches = plan_micro_batches(rows, dp_size=1, micro_batch_size=8).for_rank(0)
    loss_fn = build_algorithm(AlgorithmConfig()).loss_fn
    report = {"model": Path(hf_dir).name, "dtype": dtype, "active": active, "describe": policy.describe()}
    for setting in ("padded", "shared"):
        policy.share_prompts = setting == "shared" and active
        metrics = policy.train_step(batches, loss_fn)  # warm-up, and the step compared
        seconds = [_timed(lambda: policy.train_step(batches, loss_fn))[1] for _ in range(int(steps))]
        report[setting] = {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                           "step_s": float(np.median(seconds))}
    Path(out).write_text(json.dumps(report))
    policy.close()


if __name__ == "__main__":
    commands = {"train": train, "sync": sync, "shared": shared}
    if len(sys.argv) != 5 or sys.argv[1] not in commands:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    commands[sys.argv[1]](*sys.argv[2:])
