"""torchrun worker for tests/distributed/test_megatron_policy.py: MegatronPolicy training steps and
checkpoints at several layouts, in one 2-process group.

Usage: torchrun --nproc-per-node 2 _worker_policy.py SPEC.json, with SPEC {"out_dir", "qwen", "llama", "idefics3",
"qwen2_5_vl"} (HF model directories). Cases, in order (world size 2, so tp=pp=1 means dp=2):
- qwen_tp2: forward_logprobs of batch 1 -> `qwen_tp2.logprobs.safetensors`; step on batch 1 -> export
  `qwen_tp2.step1.hf`, checkpoint `qwen_tp2.ckpt`; step on batch 2 -> export `qwen_tp2.step2.hf`.
- qwen_pp2 (with a reference model): step on batch 1 -> `qwen_pp2.step1.hf`; then reference_logprobs of
  batch 1 -> `qwen_pp2.reference.safetensors` (must still be the initial model's).
- qwen_dp2: step on batch 1, micro-batches split over the two data-parallel ranks -> `qwen_dp2.step1.hf`.
- qwen_dp2_resumed: a fresh DP=2 policy loads `qwen_tp2.ckpt` (saved at TP=2) ->
  `qwen_dp2_resumed.loaded.hf`; step on batch 2 -> `qwen_dp2_resumed.step2.hf`.
- llama_pp2: step on batch 1 -> `llama_pp2.step1.hf`, checkpoint `llama_pp2.ckpt`.
- llama_tp2: load `llama_pp2.ckpt` (saved at PP=2) -> `llama_tp2.loaded.hf`.
- vlm_tp2 (a tiny Idefics3, no gradient clipping): forward_logprobs of `trainer_micro_batches` (samples with images
  through the trainer's path) -> `vlm_tp2.trainer_logprobs.safetensors`; step on `vlm_micro_batches` -> each TP rank's
  vision tower and connector gradients `vlm_tp2.grads.rank<r>.safetensors`, `vlm_tp2.step1.hf`, checkpoint
  `vlm_tp2.ckpt`; then a step on `trainer_micro_batches` (its metrics as `trainer_step`).
- vlm_pp2: forward_logprobs of `trainer_micro_batches` -> `vlm_pp2.trainer_logprobs.safetensors`; load `vlm_tp2.ckpt`
  (saved at TP=2) -> `vlm_pp2.loaded.hf`.
- qvlm_tp2, qvlm_pp2: the same with a tiny Qwen2.5-VL (SPEC's "qwen2_5_vl").
Step metrics go to `<case>.metrics.json` (rank 0), with `head_positions`: the number of positions the LM head
computed logits for, per micro-batch, in each step (rank 0; empty where rank 0 is not the last pipeline stage). The
entropy metric is computed in chunks of `ENTROPY_CHUNK_TOKENS` positions (7 here, so that micro-batches span several
chunks, one of them partial). The data and the loss function below are also imported by the test, which computes the
unsharded reference with transformers and torch's AdamW.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

HYPERPARAMETERS = dict(lr=1e-3, weight_decay=0.1, grad_clip=1.0, betas=(0.9, 0.95))
MICRO_BATCHES, ROWS, SEQ_LEN = 4, 2, 12
ENTROPY_CHUNK_TOKENS = 7


def micro_batches(seed: int, vocab_size: int) -> list[dict[str, torch.Tensor]]:
    """Batch-contract micro-batches: random prompt and response lengths, right padding with id 0."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(3, vocab_size, (ROWS, SEQ_LEN + 1), generator=generator)
        prompt = torch.randint(2, 5, (ROWS,), generator=generator)
        length = torch.randint(7, SEQ_LEN + 2, (ROWS,), generator=generator)
        position = torch.arange(SEQ_LEN + 1).expand(ROWS, -1)
        tokens = tokens.masked_fill(position >= length[:, None], 0)
        target_position = torch.arange(1, SEQ_LEN + 1).expand(ROWS, -1)
        loss_mask = ((target_position >= prompt[:, None]) & (target_position < length[:, None])).float()
        batches.append({"input_ids": tokens[:, :-1].contiguous(), "target_ids": tokens[:, 1:].contiguous(),
                        "position_ids": torch.arange(SEQ_LEN).expand(ROWS, -1).contiguous(),
                        "loss_mask": loss_mask})
    total_tokens = sum(b["loss_mask"].sum() for b in batches)
    for b in batches:
        b["global_tokens"] = total_tokens.clone()
        b["global_sequences"] = torch.tensor(float(MICRO_BATCHES * ROWS))
    return batches


def token_mean_nll(token_logprobs: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean negative log-likelihood over the whole step (batch contract: divide by global_tokens)."""
    mask = mb["loss_mask"].to(token_logprobs.device)
    loss = -(token_logprobs * mask).sum() / mb["global_tokens"]
    return loss, {"token_fraction": mask.sum() / mb["global_tokens"]}


def shard_for_data_parallel(batches: list, dp_rank: int, dp: int) -> list:
    per_rank = len(batches) // dp
    return batches[dp_rank * per_rank:(dp_rank + 1) * per_rank]


def run_case(spec: dict, *, name: str, model: str, tp: int, pp: int, steps: list[int],
             load: str | None = None, save_after: int | None = None, logprobs: bool = False,
             reference: bool = False) -> None:
    from megatron_bridge import parallel, schedule
    from megatron_bridge.policy import MegatronPolicy, _torch_adams

    out = Path(spec["out_dir"])
    policy = MegatronPolicy(spec[model], tp=tp, pp=pp, seed=0, reference=reference, **HYPERPARAMETERS)
    where = policy.layout
    metrics, head_positions = {}, []
    for layer in schedule.output_layers(policy.models):
        layer.register_forward_hook(lambda module, args, out: head_positions.append(out[0].shape[0]))  # [s, b, V/tp]
    if load:
        policy.load_checkpoint(out / load)
        policy.save_hf(out / f"{name}.loaded.hf")
    for step in steps:
        batches = shard_for_data_parallel(micro_batches(step, policy.vocab_size), where.dp_rank, where.dp)
        if logprobs and step == steps[0]:
            save_logprobs(policy.forward_logprobs(batches), out / f"{name}.logprobs.safetensors")
        head_positions.clear()
        metrics[f"step{step}"] = {**policy.train_step(batches, token_mean_nll), "head_positions": list(head_positions),
                                  "fused_adam": [group["fused"] for adam in _torch_adams(policy.optimizer)
                                                 for group in adam.param_groups]}
        policy.save_hf(out / f"{name}.step{step}.hf")
        if reference and step == steps[0]:
            save_logprobs(policy.reference_logprobs(batches), out / f"{name}.reference.safetensors")
        if save_after == step:
            policy.save_checkpoint(out / f"{name}.ckpt")
    if where.rank == 0:
        (out / f"{name}.metrics.json").write_text(json.dumps({"rank0": metrics,
                                                              "layout": [where.tp, where.pp, where.dp]}))
    parallel.destroy(keep_process_group=True)


# per vision-language model: its sequence length and first loss position (its batch's image blocks end before it)
VLM_SEQ_LEN = {"idefics3": (24, 16), "qwen2_5_vl": (28, 22)}
VLM_HF_KEYS = {"idefics3": ("input_ids", "pixel_values", "pixel_attention_mask"),  # what transformers' model takes
               "qwen2_5_vl": ("input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids")}


def vlm_micro_batches(hf_dir: str, model: str = "idefics3") -> list[dict[str, torch.Tensor]]:
    """Two batch-contract micro-batches of a tiny Idefics3 or Qwen2.5-VL (`_worker_bridge.IMAGE_BATCHES`, seeds 0
    and 1): the loss on the text after the images. A Qwen2.5-VL micro-batch keeps `mm_token_type_ids` (for
    transformers; megatron's schedule passes only the image keys)."""
    from _worker_bridge import IMAGE_BATCHES

    seq_len, response_from = VLM_SEQ_LEN[model]
    batches = []
    for seed in (0, 1):
        batch = IMAGE_BATCHES[model](hf_dir, seq_len=seq_len + 1, seed=seed)
        ids = batch.pop("input_ids")
        if "mm_token_type_ids" in batch:
            batch["mm_token_type_ids"] = batch["mm_token_type_ids"][:, :-1].contiguous()
        loss_mask = (torch.arange(seq_len) >= response_from).float().expand(ids.shape[0], -1).contiguous()
        batches.append({**batch, "input_ids": ids[:, :-1].contiguous(), "target_ids": ids[:, 1:].contiguous(),
                        "position_ids": torch.arange(seq_len).expand(ids.shape[0], -1).contiguous(),
                        "loss_mask": loss_mask})
    total = sum(b["loss_mask"].sum() for b in batches)
    for b in batches:
        b["global_tokens"], b["global_sequences"] = total.clone(), torch.tensor(4.0)
    return batches


# (prompt text, `{image}` standing for the processor's placeholder; image sizes; samples)
TRAINER_PROMPTS = [("User:{image}and{image}?\nAssistant:", ((40, 64), (32, 32)), 1),
                   ("", (), 1),  # a text group: its row gets no image (Idefics3: padding images)
                   ("{image}3+4=", ((20, 20),), 2),
                   ("{image}{image}which?", ((24, 40), (64, 64)), 1)]


# (group, sample, response positions) where a response sampled the image placeholder (and, for a model with one,
# the video placeholder at the next position): an ordinary token to the engine and the trainer
SAMPLED_PLACEHOLDERS = [(1, 0, (1,)), (2, 1, (0, 3))]


def trainer_groups(processor) -> list:
    """Groups of TRAINER_PROMPTS as an explorer records them: prompt ids the processor's expansion (random text ids
    for the text group), `images`, `prompt_text`, random responses, some holding placeholders
    (SAMPLED_PLACEHOLDERS: after a text prompt and after an image prompt)."""
    from rft.models.vision import image_token, placeholder, process_prompt
    from rft.schema import ExperienceGroup, Image, Sample, group_id_for
    from tests.vision_prompts import encoded_image

    rng = np.random.default_rng(0)
    sampled = [int(processor.tokenizer.convert_tokens_to_ids(image_token(processor)))]
    if isinstance(getattr(processor, "video_token", None), str):
        sampled.append(int(processor.tokenizer.convert_tokens_to_ids(processor.video_token)))
    groups = []
    for task, (template, sizes, n) in enumerate(TRAINER_PROMPTS):
        text = template.format(image=placeholder(processor))
        pictures = [Image.of(*encoded_image(w, h, seed=10 * task + j)) for j, (w, h) in enumerate(sizes)]
        prompt = (process_prompt(processor, text, [(i.data, i.media_type) for i in pictures]).token_ids
                  if pictures else rng.integers(3, 90, 9).tolist())
        responses = [rng.integers(3, 90, 5) for _ in range(n)]
        for group, sample, positions in SAMPLED_PLACEHOLDERS:
            if group == task:
                for position in positions:
                    responses[sample][position:position + len(sampled)] = sampled[:5 - position]
        samples = [Sample(sample_index=j, prompt_tokens=np.asarray(prompt), response_tokens=responses[j],
                          logprobs=np.zeros(5, np.float32), loss_mask=np.ones(5, np.uint8), reward=float(j),
                          images=pictures, prompt_text=text) for j in range(n)]
        groups.append(ExperienceGroup(run_id="run", task_id=f"t{task}", group_id=group_id_for("run", f"t{task}", 0),
                                      attempt=0, explorer_id="e", policy_version=0, samples=samples))
    return groups


def trainer_micro_batches(hf_dir: str, collate_images) -> list[dict[str, torch.Tensor]]:
    """`trainer_groups` through the trainer's path: rows with their pixels (rft.trainer.images, the model's own
    processor), micro-batches of 3 rows with `collate_images`, rows in group order: [2 images, text, 1 image] and
    [1 image (the same), 2 other images, padding]. Idefics3 or Qwen2.5-VL."""
    from rft.trainer.batch import plan_micro_batches, rows_from_groups
    from rft.trainer.images import image_prompts

    images = image_prompts(hf_dir)
    assert images is not None
    groups = trainer_groups(images.processor)
    assert [images.problem(s) for g in groups for s in g.samples] == [None] * 5  # the trainer's check takes them
    rows = rows_from_groups(groups, [np.linspace(-1.0, 1.0, len(g.samples)) for g in groups], images=images)
    return plan_micro_batches(rows, dp_size=1, micro_batch_size=3).for_rank(0, collate_images=collate_images)


def run_vlm_case(spec: dict, *, name: str, tp: int, pp: int, load: str | None = None, model: str = "idefics3") -> None:
    """A tiny vision-language policy (`model`, asked to share prompts, which it cannot): with `load`, load that
    checkpoint and export; else one step without clipping (so the gradients stay as computed), its metrics with
    `describe()`, each rank's vision tower (and connector) gradients to `<name>.grads.rank<r>.safetensors` (HF
    names; first stage only), the export and a checkpoint."""
    from safetensors.torch import save_file

    from megatron_bridge import parallel
    from megatron_bridge.model import unwrap
    from megatron_bridge.policy import MegatronPolicy

    out = Path(spec["out_dir"])
    policy = MegatronPolicy(spec[model], tp=tp, pp=pp, seed=0, share_prompts=True,
                            **{**HYPERPARAMETERS, "grad_clip": 0.0})
    trainer_batches = trainer_micro_batches(spec[model], policy.collate_images)
    save_logprobs(policy.forward_logprobs(trainer_batches), out / f"{name}.trainer_logprobs.safetensors")
    if load:
        policy.load_checkpoint(out / load)
        policy.save_hf(out / f"{name}.loaded.hf")
    else:
        metrics = policy.train_step(vlm_micro_batches(spec[model], model), token_mean_nll)
        prefixes = policy.info.bridge.first_stage_prefixes
        grads = {f"model.{n}": p.main_grad.detach().clone() for n, p in unwrap(policy.models[0]).named_parameters()
                 if n.startswith(prefixes)}
        if grads:
            save_file(grads, out / f"{name}.grads.rank{policy.layout.rank}.safetensors")
        policy.save_hf(out / f"{name}.step1.hf")
        policy.save_checkpoint(out / f"{name}.ckpt")
        trainer_step = policy.train_step(trainer_batches, token_mean_nll)
        if policy.layout.rank == 0:
            (out / f"{name}.metrics.json").write_text(json.dumps({**metrics, "describe": policy.describe(),
                                                                  "trainer_step": trainer_step}))
    parallel.destroy(keep_process_group=True)


def save_logprobs(values: list[torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    if torch.distributed.get_rank() == 0:
        save_file({f"mb{i}": v.contiguous() for i, v in enumerate(values)}, path)


def main() -> None:
    from megatron_bridge import logprobs

    logprobs.ENTROPY_CHUNK_TOKENS = ENTROPY_CHUNK_TOKENS
    spec = json.loads(Path(sys.argv[1]).read_text())
    run_case(spec, name="qwen_tp2", model="qwen", tp=2, pp=1, steps=[1, 2], save_after=1, logprobs=True)
    run_case(spec, name="qwen_pp2", model="qwen", tp=1, pp=2, steps=[1], reference=True)
    run_case(spec, name="qwen_dp2", model="qwen", tp=1, pp=1, steps=[1])
    run_case(spec, name="qwen_dp2_resumed", model="qwen", tp=1, pp=1, steps=[2], load="qwen_tp2.ckpt")
    run_case(spec, name="llama_pp2", model="llama", tp=1, pp=2, steps=[1], save_after=1)
    run_case(spec, name="llama_tp2", model="llama", tp=2, pp=1, steps=[], load="llama_pp2.ckpt")
    run_vlm_case(spec, name="vlm_tp2", tp=2, pp=1)
    run_vlm_case(spec, name="vlm_pp2", tp=1, pp=2, load="vlm_tp2.ckpt")
    run_vlm_case(spec, name="qvlm_tp2", tp=2, pp=1, model="qwen2_5_vl")
    run_vlm_case(spec, name="qvlm_pp2", tp=1, pp=2, load="qvlm_tp2.ckpt", model="qwen2_5_vl")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
