"""`python -m megatron_bridge.check HF_DIR --tp T --pp P [--ep E] [--pp-layers 1,3] [--tolerance 1e-5]`: verify
the bridge on a model.

Loads HF_DIR into a TP x PP (x EP for a mixture of experts; the layers split unevenly with --pp-layers)
megatron GPTModel, runs one seeded random token batch (a vision-language model: one random image per row, its
placeholders expanded; Qwen2.5-VL's MRoPE positions computed by each side) through megatron's
pipeline schedule and through `transformers`, and prints the largest absolute logit difference, which must be at
most `tolerance x scale`, where scale = max(1, largest |logit| of transformers): float32 rounding grows with the
logits' magnitude (a pretrained 30-layer model's logits reach ~35, a tiny random model's stay below 1); then
exports the megatron weights back (bucketed, gathered over TP and PP) and checks every HF tensor is
reproduced bit for bit. Exit status 0 when the logits are within the tolerance and the round trip is
exact, 1 otherwise, 2 on bad arguments. Started outside torchrun with T*P*E > 1, it relaunches itself
under `torch.distributed.run --standalone` with T*P*E processes (data parallel size E, which the
expert-parallel ranks are carved from).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

import megatron_bridge.device as device
import megatron_bridge.parallel as parallel
import megatron_bridge.schedule as schedule
from megatron_bridge.export import iter_hf_buckets
from megatron_bridge.hf_checkpoint import HFCheckpoint
from megatron_bridge.layout import layout_problem
from megatron_bridge.logprobs import gather_logits
from megatron_bridge.model import build_model, unwrap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_bridge.check", description=__doc__.split("\n\n")[0])
    p.add_argument("hf_dir", help="Hugging Face model directory (safetensors)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (mixtures of experts)")
    p.add_argument("--pp-layers", default=None,
                   help="decoder layers per pipeline stage, comma-separated (uneven split; default even)")
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="largest allowed |logit difference| per unit of logit scale (max(1, largest |logit|))")
    p.add_argument("--batch", type=int, default=2, help="sequences in the random batch")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--bucket-mb", type=float, default=16.0, help="export bucket size for the round trip")
    args = p.parse_args(argv)
    for name in ("tp", "pp", "ep", "batch", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        args.pp_layers = tuple(int(n) for n in args.pp_layers.split(",")) if args.pp_layers else None
    except ValueError:
        p.error(f"--pp-layers {args.pp_layers!r}: give comma-separated layer counts, e.g. 1,3")
    problem = layout_problem(args.hf_dir, tp=args.tp, pp=args.pp, ep=args.ep, pp_layers=args.pp_layers)
    if problem:
        p.error(problem)
    return args


def under_launcher() -> bool:
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


def relaunch(argv: list[str], nprocs: int) -> int:
    """Run this command again under torch.distributed.run with `nprocs` local processes."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
               "-m", "megatron_bridge.check", *argv]
    print(f"launching {nprocs} processes: {' '.join(command[1:])}", flush=True)
    return subprocess.call(command)


@dataclass
class LogitReport:
    max_abs_diff: float
    shape: tuple[int, ...]
    scale: float = 1.0  # max(1, largest |logit| of the reference): the tolerance is relative to it


def random_batch(args: argparse.Namespace, vocab_size: int, bridge=None) -> dict[str, torch.Tensor]:
    """Seeded random tokens; for a vision-language `bridge`, one random image per row and its placeholders,
    expanded, from position 1 on (ValueError when --seq-len cannot hold them): Idefics3 (a bridge with
    `image_seq_len`) `pixel_values` [batch, 1, 3, S, S]; Qwen2.5-VL (`image_grid_thw` among its `image_keys`) a
    2 x 2 grid of merged patches per image, `pixel_values` [patches, C*T*P*P], `image_grid_thw` and the
    `mm_token_type_ids` transformers computes MRoPE positions from."""
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab_size, (args.batch, args.seq_len), generator=generator)
    batch = {"input_ids": ids, "position_ids": torch.arange(args.seq_len).expand(args.batch, -1).contiguous()}
    grids = "image_grid_thw" in getattr(bridge, "image_keys", ())
    placeholders = 4 if grids else getattr(bridge, "image_seq_len", 0)
    if placeholders:
        if args.seq_len < placeholders + 1:
            raise ValueError(f"--seq-len {args.seq_len} cannot hold an image's {placeholders} placeholders")
        token = bridge.image_token_id
        stray = {token, getattr(bridge.vlm, "video_token_id", None)}  # no stray placeholders in the text
        text = next(t % vocab_size for t in range(token + 1, token + 4) if t % vocab_size not in stray)
        for t in stray - {None}:
            ids[ids == t] = text
        ids[:, 1:1 + placeholders] = token
    if grids:
        vision = bridge.vlm.vision_config
        side = 2 * int(vision.spatial_merge_size)
        width = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
        batch["image_grid_thw"] = torch.tensor([[1, side, side]] * args.batch)
        batch["pixel_values"] = torch.randn(args.batch * side * side, width, generator=generator)
        batch["mm_token_type_ids"] = (ids == bridge.image_token_id).int()
    elif placeholders:
        side = bridge.image_size
        batch["pixel_values"] = torch.randn(args.batch, 1, 3, side, side, generator=generator)
    return batch


def compare_logits(models, args: argparse.Namespace) -> LogitReport:
    """Max |megatron - transformers| logit difference, known on every rank."""
    info = unwrap(models[0]).bridge_info
    batch = random_batch(args, info.dims.vocab_size, info.bridge)
    outputs = schedule.run(models, [batch], lambda logits, mb: gather_logits(logits, info.dims.vocab_size),
                           forward_only=True)
    where = parallel.layout()
    diff, scale = torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)
    if where.is_last_stage and where.tp_rank == 0 and where.dp_rank == 0:
        reference = transformers_logits(args, batch, image_keys=info.bridge.image_keys)
        diff = (outputs[0].float().cpu() - reference).abs().max().double()
        scale = torch.clamp(reference.abs().max().double(), min=1.0)
    _all_max(diff)
    _all_max(scale)
    return LogitReport(max_abs_diff=float(diff), shape=tuple(batch["input_ids"].shape), scale=float(scale))


def _all_max(value: torch.Tensor) -> None:
    """Replace `value` (a CPU tensor) by its maximum over all ranks."""
    moved = value.to(device.compute_device())
    dist.all_reduce(moved, op=dist.ReduceOp.MAX)
    value.copy_(moved.cpu())


def transformers_logits(args: argparse.Namespace, batch: dict[str, torch.Tensor], *,
                        image_keys: tuple[str, ...] = ()) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    dtype = getattr(torch, args.dtype)
    target = device.compute_device()  # the GPU on a GPU machine: both sides then use CUDA kernels
    auto = AutoModelForImageTextToText if "pixel_values" in batch else AutoModelForCausalLM
    model = auto.from_pretrained(args.hf_dir, dtype=dtype).to(target)  # type: ignore[arg-type]  # transformers' wrapped `to`
    images = {k: v.to(target, dtype) if v.is_floating_point() else v.to(target) for k, v in batch.items()
              if k in image_keys}
    # Qwen2.5-VL computes its MRoPE positions itself, from the placeholders' token types
    positions = "mm_token_type_ids" if "mm_token_type_ids" in batch else "position_ids"
    with torch.no_grad():
        return model(input_ids=batch["input_ids"].to(target), **{positions: batch[positions].to(target)},
                     **images).logits.float().cpu()


def round_trip(models, args: argparse.Namespace) -> list[str]:
    """Problems found comparing the exported tensors with the HF checkpoint (rank 0; [] elsewhere)."""
    info = unwrap(models[0]).bridge_info
    problems: list[str] = []
    seen: set[str] = set()
    source = HFCheckpoint(args.hf_dir) if parallel.layout().is_publisher else None
    for bucket in iter_hf_buckets(models, int(args.bucket_mb * (1 << 20))):
        assert source is not None  # the buckets come out on the publishing rank only
        for name, tensor in bucket.items():
            seen.add(name)
            if name not in source:
                problems.append(f"{name}: exported but not in the checkpoint")
                continue
            expected = source.read(name).to(tensor.dtype)  # the load cast to the model dtype, if any
            if not _identical(tensor.cpu(), expected):
                problems.append(f"{name}: differs (max |diff| {_max_diff(tensor.cpu(), expected):.3g})")
    if source is not None:
        missing = set(source.names()) - seen
        if info.bridge.tied_embeddings:
            missing.discard("lm_head.weight")  # a tied checkpoint may carry a copy of the embedding
        problems += [f"{name}: in the checkpoint but not exported" for name in sorted(missing)]
        source.close()
    return problems


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max())


def worker(args: argparse.Namespace) -> int:
    where = parallel.initialize(args.tp, args.pp, ep=args.ep, seed=args.seed)
    try:
        models = build_model(args.hf_dir, dtype=args.dtype, pp_layers=args.pp_layers)
        info = unwrap(models[0]).bridge_info
        say = print if where.is_publisher else (lambda *a, **k: None)
        say(f"{args.hf_dir}: {info.bridge.hf_class}, tp={where.tp} pp={where.pp} "
            f"(layers {','.join(map(str, info.stage_layers))}) ep={where.ep} dp={where.dp} "
            f"({where.backend}), dtype {args.dtype}, vocab {info.dims.vocab_size} padded to "
            f"{info.dims.padded_vocab_size}, transformer_engine={info.transformer_engine}", flush=True)
        logits = compare_logits(models, args)
        logits_ok = logits.max_abs_diff <= args.tolerance * logits.scale
        say(f"logits: random batch {logits.shape[0]}x{logits.shape[1]}, max |megatron - transformers| = "
            f"{logits.max_abs_diff:.3e} (tolerance {args.tolerance:.1e} x logit scale {logits.scale:.3g})  "
            f"{'OK' if logits_ok else 'FAIL'}", flush=True)
        problems = round_trip(models, args)
        say(f"round trip HF -> megatron -> HF: {'every tensor identical  OK' if not problems else 'FAIL'}",
            flush=True)
        for problem in problems:
            say(f"  {problem}", flush=True)
        failed = torch.tensor(0 if logits_ok and not problems else 1)
        _all_max(failed)
        return int(failed)
    finally:
        parallel.destroy()


def quiet_known_warnings() -> None:
    """Hide the import-time notices of megatron-core without TE/Apex, so the report stays readable."""
    for message in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                    "When using async grad allreduce", r"`torch.distributed.all_gather_into_tensor` is deprecated",
                    "full scope is deprecated"):
        warnings.filterwarnings("ignore", message=message)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quiet_known_warnings()
    args = parse_args(argv)
    nprocs = args.tp * args.pp * args.ep
    if not under_launcher() and nprocs > 1:
        return relaunch(argv, nprocs)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
