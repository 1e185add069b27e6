"""torchrun worker for tests/distributed/test_megatron_bridge.py: HF -> megatron -> HF conversion cases.

Usage: torchrun --nproc-per-node N _worker_bridge.py SPEC.json. The spec lists cases
{"name", "hf_dir", "tp", "pp"} (optionally "ep", and "pp_layers" for an uneven pipeline split) and an output
directory. For every case, in one process group:
- `<name>.logits.safetensors` (written by the rank holding the full logits): `input_ids` of a seeded
  random batch (with "images": "idefics3", a vision-language batch with `pixel_values` and `pixel_attention_mask`,
  `image_batch`; "qwen2_5_vl": `qwen_image_batch`) and megatron's logits for it, gathered over TP, padding columns
  dropped;
- `<name>.mismatch.txt` (images, one pipeline stage; rank 0): the error of the same batch with one image placeholder
  replaced by a text token;
- `<name>.bf16_tower_rope.safetensors` (Qwen2.5-VL at TP1 x PP1; rank 0): the vision tower's rotary frequencies of
  the same model built in bfloat16;
- `<name>.hf/`: the model exported with `save_hf` (bucketed, gathered over TP and PP);
- `<name>.export.json` (rank 0): a second, bucketed export, with the bucket contents' sizes and the
  peak resident memory of the process during it above the level at its start (VmHWM after
  resetting it through /proc/self/clear_refs). The test launches this script with
  MALLOC_MMAP_THRESHOLD_=65536 so that glibc returns every freed tensor of 64 KiB or more to the OS
  at once; resident memory then follows the tensors actually held, including gloo's own buffers.
The assertions (against transformers) are in the test; this script only produces results.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_bridge import parallel, schedule
from megatron_bridge.export import iter_hf_buckets, save_hf
from megatron_bridge.logprobs import gather_logits
from megatron_bridge.model import build_model


def random_batch(vocab_size: int, *, batch: int = 2, seq_len: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=generator)
    return {"input_ids": ids, "position_ids": torch.arange(seq_len).expand(batch, -1).contiguous()}


def image_batch(hf_dir: str, *, seq_len: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """A seeded two-row batch for a tiny Idefics3 (rft.models.tiny_vlm): row 0 one image, row 1 two (row 0's second
    image slot all-zero padding, which transformers drops; row 1's second image 3/4 wide, the rest masked by
    `pixel_attention_mask`), each `<fake><global-img><image> x n<fake>` as the processor expands it, then random text
    tokens (no special ones)."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    vision, image_token = config["vision_config"], config["image_token_id"]
    side, n = vision["image_size"], (vision["image_size"] // vision["patch_size"]) ** 2 // config["scale_factor"] ** 2
    fake, global_img = image_token - 1, image_token + 1  # the tiny model's tokenizer: <fake>, <image>, <global-img>
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, fake, (2, seq_len), generator=generator)
    block = torch.tensor([fake, global_img] + [image_token] * n + [fake])
    for row, starts in ((0, [3]), (1, [1, 2 + len(block)])):
        for start in starts:
            ids[row, start:start + len(block)] = block
    pixels = torch.randn(2, 2, 3, side, side, generator=generator)
    pixels[0, 1] = 0.0
    mask = torch.ones(2, 2, side, side, dtype=torch.int64)
    mask[0, 1] = 0
    mask[1, 1, :, 3 * side // 4:] = 0
    pixels[1, 1, :, :, 3 * side // 4:] = 0.0
    return {"input_ids": ids, "position_ids": torch.arange(seq_len).expand(2, -1).contiguous(), "pixel_values": pixels,
            "pixel_attention_mask": mask}


QWEN_GRIDS = ([(1, 4, 4)], [(1, 8, 6), (1, 4, 4)])  # per row: each image's (t, h, w) patch grid


def qwen_image_batch(hf_dir: str, *, seq_len: int = 28, seed: int = 0) -> dict[str, torch.Tensor]:
    """A seeded two-row batch for a tiny Qwen2.5-VL (rft.models.tiny_vlm): row 0 one image (4 placeholders) and 4
    padding tokens at its end, row 1 two (12 and 4), each `<|vision_start|><|image_pad|> x n<|vision_end|>` as the
    processor expands it, random text tokens (no special ones) elsewhere; `pixel_values` [patches, C*T*P*P] and
    `image_grid_thw` as collated, and `mm_token_type_ids` (what transformers' model needs to compute MRoPE)."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    vision, image_token = config["vision_config"], config["image_token_id"]
    start, end, merge = config["vision_start_token_id"], config["vision_end_token_id"], vision["spatial_merge_size"]
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, start - 2, (2, seq_len), generator=generator)  # below <|im_start|>, <|im_end|>
    for row, grids in enumerate(QWEN_GRIDS):
        at = 2 - row
        for t, h, w in grids:
            block = torch.tensor([start] + [image_token] * (t * h * w // merge ** 2) + [end])
            ids[row, at:at + len(block)] = block
            at += len(block) + 1
    ids[0, -4:] = 0  # right padding
    grid = torch.tensor([g for grids in QWEN_GRIDS for g in grids])
    width = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    pixels = torch.randn(int(grid.prod(-1).sum()), width, generator=generator)
    return {"input_ids": ids, "position_ids": torch.arange(seq_len).expand(2, -1).contiguous(), "pixel_values": pixels,
            "image_grid_thw": grid, "mm_token_type_ids": (ids == image_token).int()}


IMAGE_BATCHES = {"idefics3": image_batch, "qwen2_5_vl": qwen_image_batch}  # a case's "images": its batch


def _memory_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1))


def peak_memory_during(run) -> int:
    """Peak resident bytes while `run()` executes, above the resident level at its start."""
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current VmRSS
    start = _memory_kib("VmRSS")
    run()
    return (_memory_kib("VmHWM") - start) * 1024


def measured_export(models, bucket_bytes: int) -> dict:
    buckets: list[dict] = []

    def consume():
        for bucket in iter_hf_buckets(models, bucket_bytes):
            buckets.append({name: t.numel() * t.element_size() for name, t in bucket.items()})
            del bucket

    peak = peak_memory_during(consume)
    return {"peak_bytes": peak, "bucket_bytes": bucket_bytes, "buckets": buckets}


def run_case(case: dict, out: Path, bucket_bytes: int) -> None:
    where = parallel.initialize(case["tp"], case["pp"], ep=case.get("ep", 1))
    pp_layers = case.get("pp_layers")
    models = build_model(case["hf_dir"], pp_layers=tuple(pp_layers) if pp_layers else None)
    vocab = models[0].bridge_info.dims.vocab_size
    images = IMAGE_BATCHES.get(case.get("images", ""))
    batch = images(case["hf_dir"]) if images else random_batch(vocab)
    logits = schedule.run(models, [batch], lambda shard, mb: gather_logits(shard, vocab), forward_only=True)
    if where.is_last_stage and where.tp_rank == 0 and where.dp_rank == 0:
        save_file({**{k: v for k, v in batch.items() if k != "position_ids"}, "logits": logits[0].contiguous()},
                  out / f"{case['name']}.logits.safetensors")
    if case.get("images") and case["pp"] == 1:  # one placeholder short: refused on every rank (one stage: no hang)
        short = dict(batch, input_ids=batch["input_ids"].clone())
        short["input_ids"][0, 5] = 3
        try:
            schedule.run(models, [short], lambda shard, mb: gather_logits(shard, vocab), forward_only=True)
        except ValueError as e:
            if where.rank == 0:
                (out / f"{case['name']}.mismatch.txt").write_text(str(e))
    if case.get("images") == "qwen2_5_vl" and case["tp"] == case["pp"] == 1:
        rope = build_model(case["hf_dir"], dtype="bfloat16")[0].visual.rotary_pos_emb  # the tower's after the cast
        if where.rank == 0:
            save_file({"inv_freq": rope.inv_freq, "original_inv_freq": rope.original_inv_freq},
                      out / f"{case['name']}.bf16_tower_rope.safetensors")
    save_hf(models, out / f"{case['name']}.hf")
    export = measured_export(models, bucket_bytes)
    if where.is_publisher:
        (out / f"{case['name']}.export.json").write_text(json.dumps(export))
    parallel.destroy(keep_process_group=True)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out_dir"])
    for case in spec["cases"]:
        run_case(case, out, spec["bucket_bytes"])
    parallel.destroy()


if __name__ == "__main__":
    main()
