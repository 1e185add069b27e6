"""`MegatronPolicy`: the trainer's model, a TP/PP/DP-sharded megatron GPTModel loaded from HF, with megatron's DDP,
optimizer and pipeline schedule, behind the few operations the trainer needs.

Every method is collective: one policy per process on every rank, methods called on all ranks in the same order;
each data-parallel rank passes its own micro-batches (the same list on every TP and PP rank of a replica).

Optimizer: megatron's `get_megatron_optimizer` (Adam, decoupled weight decay not on biases and norms, gradients
clipped to `grad_clip` by the global norm, TP duplicates counted once). With Transformer Engine or Apex it is the
distributed optimizer (state sharded over DP ranks); without them torch's AdamW (fused CPU kernel, `_fuse_cpu_adam`)
with the non-distributed optimizer, because megatron-core's distributed optimizer cannot reload a fully reshardable
checkpoint there (KeyError 'step'). `distributed_optimizer` tells which. Learning rate and weight decay are constant.
Reference model (`reference=True`): a frozen copy of `hf_dir` with the same sharding, in eval mode (with LoRA: the
policy's base with adapters off). Teacher (`teacher=DIR`): another HF directory, frozen, sharded like the policy,
with the policy's vocabulary size (ValueError otherwise); `teacher_logprobs` scores at the policy's temperature.
Loss contract: `loss_fn` returns each micro-batch's contribution to the global step loss; megatron runs in
per-token-loss mode (no division by micro-batches, no DP averaging), so gradients are those of the global loss.
float16 only: megatron's dynamic loss scaler from `initial_loss_scale` (overflowing steps: `step_skipped` 1.0).
Checkpoints: megatron `dist_checkpointing` ("torch_dist", fully reshardable across TP/PP/DP, works on CPU), with
`rft_policy.json` (step count, layout); saves are synchronous (`checkpoint_results_in_process`).
"""
from __future__ import annotations

import json
import math
import queue
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import megatron_bridge.device as device
import megatron_bridge.export as export
import megatron_bridge.lora as adapters
import megatron_bridge.moe_losses as moe_losses
import megatron_bridge.packing as packing
import megatron_bridge.parallel as parallel
import megatron_bridge.routing_replay as routing_replay_module
import megatron_bridge.schedule as schedule
import megatron_bridge.shared_prompts as shared_prompts
from megatron_bridge.info import BridgeInfo
from megatron_bridge.layout import vocabulary_problem
from megatron_bridge.logprobs import entropy_sum, token_logprobs, token_statistics
from megatron_bridge.model import build_model, config_of, unwrap
from rft.tensors import all_finite

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from rft.models.config import LoraConfig

LossFn = Callable[[torch.Tensor, dict], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}
POLICY_FILE = "rft_policy.json"
MAX_SUFFIX = "_max"  # metrics reduced by max over micro-batches and data-parallel ranks (the others are summed)
POLICY_METRICS = ("loss", "entropy")  # train_step's own metric names; a loss function may not return them


class TrainedModel:
    """What a trained, sharded megatron model has besides its forward: DDP wrapping, megatron's optimizer and
    constant-rate scheduler, the optimizer step over batch-contract micro-batches, metric sums over replicas, and
    dist_checkpointing save/load (see the module docstring). Subclasses call `_train` with their built model chunks
    after `parallel.initialize`, and set `layout`."""

    layout: parallel.ParallelLayout
    info: BridgeInfo
    steps: int = 0
    kind = "policy"  # what a checkpoint of it is called in errors
    _shared_note = ""  # `describe`'s note on shared prompts (MegatronPolicy sets it)

    def _train(self, models: list[GPTModel], *, lr: float, weight_decay: float, grad_clip: float,
               betas: tuple[float, float], eps: float, dtype: str, initial_loss_scale: float) -> None:
        """Wrap `models` (built by `build_model`) in megatron's DDP and give them an optimizer and scheduler."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.info = models[0].bridge_info
        self.config = config_of(models[0])
        self.distributed_optimizer = distributed_optimizer_available()
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=self.distributed_optimizer)
        self.models = [DistributedDataParallel(self.config, ddp_config, m) for m in models]
        self.optimizer, self.scheduler = _build_optimizer(
            self.models, lr=lr, weight_decay=weight_decay, grad_clip=grad_clip, betas=betas, eps=eps, dtype=dtype,
            distributed=self.distributed_optimizer, initial_loss_scale=initial_loss_scale)
        # megatron's schedule multiplies each micro-batch's loss by grad_scale_func(1) before backward, and the
        # optimizer divides the gradients by the same scale: without this, float16 gradients were divided by a
        # scale that had never multiplied them (Megatron-LM's training loop sets the same hook).
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.moe_loss_coefficients = moe_losses.prepare(self.models) if self.config.num_moe_experts else None
        self.steps = 0

    def _optimizer_step(self, micro_batches: list[dict[str, torch.Tensor]], on_output, *,
                        packed: bool = False, before_forward=None, head_from_loss: bool = False,
                        share_prompts: bool = False) -> dict[str, float]:
        """One optimizer step: `on_output(model output on the last stage, micro_batch) -> (loss, metrics)` per
        micro-batch (schedule.run's training contract, `head_from_loss` and `share_prompts` passed on); returns the
        metrics summed over micro-batches and data-parallel ranks, plus `grad_norm` and `step_skipped`, on every
        rank."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads

        _check_micro_batches(micro_batches, extra=("loss_mask", "global_tokens"))
        for model in self.models:
            model.train()
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        moe = self.moe_loss_coefficients
        if moe:
            count = moe_losses.set_step_coefficients(self.models, moe, len(micro_batches), ps.get_data_parallel_group())
        per_micro_batch = schedule.run(self.models, micro_batches, on_output, forward_only=False, packed=packed,
                                       before_forward=before_forward, head_from_loss=head_from_loss,
                                       share_prompts=share_prompts)
        finalize_model_grads(self.models)
        totals = self._sum_over_replicas(per_micro_batch)
        if self._update_is_finite(totals.get("loss", 0.0)):
            succeeded, grad_norm, _ = self.optimizer.step()
        else:  # a NaN / inf loss or gradient would poison the weights (and every engine that loads them)
            succeeded, grad_norm = False, None
        self.scheduler.step(1)
        self.steps += 1
        totals["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        totals["step_skipped"] = 0.0 if succeeded else 1.0
        if moe:
            totals.update(moe_losses.step_metrics(self.models, moe, count, ps.get_data_parallel_group()))
        return totals

    def _update_is_finite(self, loss: float) -> bool:
        """Collective: False (on every rank) when `loss` (summed over replicas: the same everywhere) or any rank's
        gradients hold a NaN or an infinity; the caller then skips the optimizer step. With fp16 only the loss:
        megatron's loss scaler finds non-finite gradients itself and must see them, to lower its scale."""
        finite = math.isfinite(loss)
        if finite and not self.config.fp16:
            finite = all_finite([p.main_grad for m in self.models for p in m.parameters()
                              if getattr(p, "main_grad", None) is not None])
        return _on_every_rank(finite)

    def collate_images(self, per_row: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """A micro-batch's image tensors from its rows' processor outputs: the model family's `collate_images`
        (megatron_bridge.models.base; ValueError for a text model)."""
        return self.info.bridge.collate_images(per_row)

    def weights_finite(self) -> bool:
        """Collective: True (on every rank) when no rank's trained parameters hold a NaN or an infinity. The trainer
        asks before publishing a version: non-finite weights are never published. Frozen parameters (a LoRA base)
        cannot change between versions and are not published with them, so only trained ones are read."""
        return _on_every_rank(all_finite([p.data for m in self.models for p in m.parameters() if p.requires_grad]))

    def describe(self) -> str:
        """One line for logs: ranks and layout, the device and backend, dtype, optimizer state sharding."""
        layout, where = self.layout, next(self.models[0].parameters()).device
        return (f"{layout.world_size} ranks (tp {layout.tp} x pp {layout.pp} x dp {layout.dp}, ep {layout.ep}) "
                f"on {where.type} ({layout.backend}), {self.config.params_dtype}, "
                f"{'distributed' if self.distributed_optimizer else 'replicated'} optimizer state"
                f"{self._lora_description()}{self._shared_note}")

    def _lora_description(self) -> str:
        if self.lora is None:
            return ""
        trainable = sum(p.numel() for m in self.models for p in m.parameters() if p.requires_grad)
        return (f", LoRA rank {self.lora.rank} on {', '.join(self.lora.target_modules)} ({trainable:,} trainable "
                f"parameters on this rank)")

    def sum_over_data_parallel(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (CPU) summed over this rank's data-parallel group, on every rank (CPU result)."""
        from megatron.core import parallel_state as ps

        if self.layout.dp == 1:
            return tensor
        buffer = tensor.to(device.compute_device()).contiguous()
        torch.distributed.all_reduce(buffer, group=ps.get_data_parallel_group())
        return buffer.cpu()

    def _sum_over_replicas(self, per_micro_batch: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Reduce metric dicts over micro-batches (last stage), then data-parallel ranks; same dict everywhere.
        A metric whose name ends in `_max` is reduced by max (e.g. `logprob_mismatch_max`), every other by sum."""
        from megatron.core import parallel_state as ps

        names = sorted(per_micro_batch[0]) if per_micro_batch else None
        names = _broadcast_names(names)
        is_max = torch.tensor([n.endswith(MAX_SUFFIX) for n in names], device=device.compute_device())
        sums = torch.zeros(len(names), dtype=torch.float64, device=device.compute_device())
        maxima = torch.full_like(sums, float("-inf"))
        if self.layout.is_last_stage:
            for metrics in per_micro_batch:
                values = torch.stack([metrics[n].double().to(sums.device).reshape(()) for n in names])
                sums += values
                maxima = torch.maximum(maxima, values)
            dist.all_reduce(sums, group=ps.get_data_parallel_group())
            if bool(is_max.any()):  # the same names on every rank, so every rank takes this branch or none
                dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        values = _from_last_stage(torch.where(is_max, maxima, sums), (len(names),), dtype=torch.float64)
        return {name: float(v) for name, v in zip(names, values.tolist(), strict=True)}

    # ---- checkpoints

    # a MegatronPolicy's model.lora with rank > 0: the checkpoint holds the adapters only
    lora: LoraConfig | None = None

    def _sharded_state(self, *, is_loading: bool) -> dict:
        model_state = unwrap(self.models[0]).sharded_state_dict()
        if self.lora is not None:  # the base is model.path's, frozen: the adapters (and their Adam state) only
            model_state = {k: v for k, v in model_state.items() if adapters.is_adapter(k)}
        return {"model": model_state,
                "optimizer": self.optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                               metadata=OPTIMIZER_SHARDING),
                "scheduler": self.scheduler.state_dict()}

    def save_checkpoint(self, checkpoint_dir: str | Path) -> Path:
        """Model + optimizer + scheduler with megatron dist_checkpointing (reloadable at any TP/PP/DP)."""
        from megatron.core import dist_checkpointing

        out = Path(checkpoint_dir)
        if self.layout.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        checkpoint_results_in_process()
        dist.barrier()
        dist_checkpointing.save(self._sharded_state(is_loading=False), str(out))
        if self.layout.rank == 0:
            (out / POLICY_FILE).write_text(json.dumps(
                {"steps": self.steps, "tp": self.layout.tp, "pp": self.layout.pp, "dp": self.layout.dp,
                 "architecture": self.info.bridge.hf_class, "hf_dir": str(self.info.hf_dir),
                 "lora": self._lora_meta()}, indent=2) + "\n")
        dist.barrier()
        return out

    def load_checkpoint(self, checkpoint_dir: str | Path) -> None:
        """Restore a checkpoint written by `save_checkpoint`, whatever layout it was saved at."""
        from megatron.core import dist_checkpointing

        src = Path(checkpoint_dir)
        meta_file = src / POLICY_FILE
        if not meta_file.is_file():
            raise FileNotFoundError(f"{src}: not a {self.kind} checkpoint (no {POLICY_FILE})")
        meta = json.loads(meta_file.read_text())
        if meta["architecture"] != self.info.bridge.hf_class:
            raise ValueError(f"{src}: checkpoint of a {meta['architecture']}, this {self.kind} is a "
                             f"{self.info.bridge.hf_class}")
        if meta.get("lora") != self._lora_meta():
            raise ValueError(f"{src}: checkpoint of LoRA settings {meta.get('lora')}, this {self.kind} has "
                             f"{self._lora_meta()} (model.lora must match the run's checkpoints)")
        state = dist_checkpointing.load(self._sharded_state(is_loading=True), str(src))
        missing, unexpected = unwrap(self.models[0]).load_state_dict(state["model"], strict=self.lora is None)
        if self.lora is not None and ([k for k in missing if adapters.is_adapter(k)] or unexpected):
            raise ValueError(f"{src}: adapter checkpoint does not fit this model: missing "
                             f"{[k for k in missing if adapters.is_adapter(k)][:5]}, unexpected {unexpected[:5]}")
        self.optimizer.load_state_dict(state["optimizer"])
        _fuse_cpu_adam(self.optimizer)  # the loaded parameter groups carry the flag they were saved with
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(meta["steps"])

    def _lora_meta(self) -> dict | None:
        """The LoRA settings a checkpoint must match (None: full fine-tuning)."""
        if self.lora is None:
            return None
        return {"rank": self.lora.rank, "alpha": self.lora.alpha, "target_modules": sorted(self.lora.target_modules)}

    def close(self) -> None:
        """Tear down megatron's parallel state and the process group."""
        parallel.destroy()


class MegatronPolicy(TrainedModel):
    """A sharded causal LM that trains on batch-contract micro-batches (see the module docstring)."""

    def __init__(self, hf_dir: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1, lr: float,
                 weight_decay: float = 0.0, grad_clip: float = 1.0, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, seed: int = 0, dtype: str = "float32", reference: bool = False,
                 temperature: float = 1.0, initial_loss_scale: float = 2.0 ** 16, pack_sequences: bool = False,
                 teacher: str | Path | None = None, moe_aux_loss_coeff: float = 0.0, moe_z_loss_coeff: float = 0.0,
                 routing_replay: bool = False, lora: LoraConfig | None = None, share_prompts: bool = False):
        """`temperature`: the sampling temperature of the explorers. Log-probs (and entropy) are those of
        softmax(logits / temperature), the distribution the behaviour log-probs in the records come from, so
        that importance ratios compare like with like. `initial_loss_scale`: float16 only, the dynamic loss
        scale's starting value (see "Loss scaling" in the module docstring). `pack_sequences`: every forward runs
        each micro-batch as one packed sequence (megatron_bridge.packing; Transformer Engine on a GPU, pp 1). `ep`:
        expert parallel size (a mixture of experts; carved out of the data-parallel ranks); `moe_aux_loss_coeff`,
        `moe_z_loss_coeff`: the router's load-balancing and z-loss coefficients (megatron_bridge.moe_losses; 0: off),
        reported per step as `moe_load_balancing_loss` / `moe_z_loss`. `routing_replay`: the policy's MoE routers
        replay each micro-batch's `routed_experts` in `train_step` and `forward_logprobs`
        (megatron_bridge.routing_replay; ValueError for a model without routers); the reference and teacher models
        route by themselves. `lora` (rank > 0): train LoRA adapters only (megatron_bridge.lora; "LoRA" in the
        module docstring; dense models). `share_prompts`: `train_step` runs the rows of a micro-batch that share a
        prompt as one sequence with the prompt once (megatron_bridge.shared_prompts), where the model allows it (else
        padded, and `describe` says why)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (greedy sampling has no log-probs to train on), "
                             f"got {temperature}")
        self.temperature = temperature
        if teacher is not None and (problem := vocabulary_problem(str(hf_dir), str(teacher))):
            raise ValueError(f"teacher model: {problem}")
        if lr <= 0 or weight_decay < 0 or grad_clip < 0:
            raise ValueError(f"need lr > 0, weight_decay >= 0, grad_clip >= 0; got lr={lr} "
                             f"weight_decay={weight_decay} grad_clip={grad_clip}")
        if pack_sequences and (pp != 1 or not packing.packing_supported()):
            raise ValueError(f"pack_sequences needs Transformer Engine on a GPU and pp 1 (pp {pp}, Transformer Engine "
                             f"in use: {packing.packing_supported()})")
        self.pack_sequences = pack_sequences
        self.lora = lora if lora is not None and lora.rank else None
        if self.lora is not None and pack_sequences:
            raise ValueError("LoRA adapters use megatron's local layer spec, which cannot pack sequences")
        self.layout = parallel.initialize(tp, pp, ep=ep, seed=seed)
        model = build_model(hf_dir, dtype=dtype, aux_loss_coeff=moe_aux_loss_coeff, z_loss_coeff=moe_z_loss_coeff,
                            lora=self.lora, seed=seed)
        self._train(model, lr=lr, weight_decay=weight_decay, grad_clip=grad_clip,
                    betas=betas, eps=eps, dtype=dtype, initial_loss_scale=initial_loss_scale)
        if pack_sequences and self.info.bridge.image_keys:
            raise ValueError(f"pack_sequences: {hf_dir} is a vision-language model, and packed sequences do not "
                             "take images; turn it off")
        self.routing_replay = routing_replay
        if routing_replay:
            if pack_sequences:
                raise ValueError("routing_replay does not replay packed sequences; turn pack_sequences off")
            if not routing_replay_module.install(self.models):
                raise ValueError(f"routing_replay needs a mixture-of-experts model; {hf_dir} has no routers")
        why_not = None if not share_prompts else "sequences packed" if pack_sequences else \
            shared_prompts.applies(self.models[0])
        self.share_prompts = share_prompts and why_not is None
        self._shared_note = ("" if not share_prompts else f", prompts not shared ({why_not})" if why_not
                             else ", prompts shared")
        # LoRA: the reference is the policy's own frozen base with its adapters switched off (no second copy)
        self.reference = reference
        self.reference_models = (_frozen(build_model(hf_dir, dtype=dtype))
                                 if reference and self.lora is None else None)
        self.teacher_models = _frozen(build_model(teacher, dtype=dtype)) if teacher is not None else None
        # called with no arguments before each micro-batch's forward, in the thread that runs the forward and the
        # backward (the trainer's CPU core share resizes torch's threads there: rft/cores.py); None: nothing
        self.pace: Callable[[], None] | None = None

    @property
    def vocab_size(self) -> int:
        return self.info.dims.vocab_size

    # ---- training

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over this DP rank's micro-batches. Returns, on every rank, `loss`, `entropy`
        and each metric summed over micro-batches and data-parallel ranks (maximum for names ending in `_max`),
        plus `grad_norm` (before clipping)
        and `step_skipped` (1.0 when megatron skipped the update, e.g. non-finite gradients). The LM head runs only
        from each micro-batch's first loss position (schedule.run's `head_from_loss`): `loss_fn` gets log-probs and
        the micro-batch's [b, T, ...] tensors cut to [b, T - first, ...] (`head_from` = first)."""
        def on_logits(logits, mb):
            logits = self._tempered(logits)
            entropy = entropy_sum(logits, mb["loss_mask"], self.vocab_size) / mb["global_tokens"].clamp(min=1)
            loss, metrics = loss_fn(token_logprobs(logits, mb["target_ids"], self.vocab_size), mb)
            reserved = sorted(set(metrics) & set(POLICY_METRICS))
            if reserved:
                raise ValueError(f"loss function returned metrics {reserved}, names that train_step reports itself")
            return loss, {"loss": loss.detach(), "entropy": entropy, **{k: v.detach() for k, v in metrics.items()}}

        return self._optimizer_step(micro_batches, on_logits, packed=self.pack_sequences,
                                    before_forward=self._before_forward(self.models), head_from_loss=True,
                                    share_prompts=self.share_prompts)

    def forward_logprobs(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """token_logprobs [b, T] (float32, CPU) for each micro-batch, without gradients, on every rank
        of this replica (the last stage computes them and broadcasts over the pipeline group)."""
        for model in self.models:
            model.eval()
        return self._logprobs(self.models, micro_batches)

    def step_start(self, micro_batches: list[dict[str, torch.Tensor]], *, entropy: bool = False,
                   collision: bool = False) -> list[dict[str, torch.Tensor]]:
        """Per-token quantities [b, T] (float32, CPU) at the current weights, without gradients, for each micro-batch,
        on every rank of this replica: `start_logprobs` always; `start_entropy` (the entropy of the tempered
        distribution) with `entropy`; `start_collision` (sum_v p_v^2 (log p_v + H)) with `collision`. Entropy and the
        collision term are computed at `loss_mask` positions only (0 elsewhere): megatron_bridge.logprobs's
        `token_statistics`, vocabulary-parallel over the TP group. The pass before the step of `Needs.step_start`."""
        _check_micro_batches(micro_batches, extra=("loss_mask",))
        stats = entropy or collision

        def on_logits(logits, mb):
            logits = self._tempered(logits)
            rows = [token_statistics(logits, mb["loss_mask"], self.vocab_size, collision=collision)] if stats else []
            return torch.cat([token_logprobs(logits, mb["target_ids"], self.vocab_size)[None], *rows])

        for model in self.models:
            model.eval()
        with torch.no_grad():
            results = schedule.run(self.models, micro_batches, on_logits, forward_only=True,
                                   packed=self.pack_sequences, before_forward=self._before_forward(self.models))
        out = []
        for i, mb in enumerate(micro_batches):
            values = _from_last_stage(results[i] if results else None, (3 if stats else 1, *mb["target_ids"].shape))
            out.append({"start_logprobs": values[0], **({"start_entropy": values[1]} if entropy else {}),
                        **({"start_collision": values[2]} if collision else {})})
        return out

    def reference_logprobs(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """As `forward_logprobs`, from the frozen reference model (the weights at `hf_dir`); needs a
        policy built with `reference=True`."""
        if not self.reference:
            raise RuntimeError("reference_logprobs: this MegatronPolicy was built without reference=True")
        if self.reference_models is None:  # LoRA: the base is the reference
            for model in self.models:
                model.eval()
            with adapters.disabled(self.models):
                return self._logprobs(self.models, micro_batches)
        return self._logprobs(self.reference_models, micro_batches)

    def teacher_logprobs(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """As `forward_logprobs`, from the frozen teacher model; needs a policy built with `teacher=DIR`."""
        if self.teacher_models is None:
            raise RuntimeError("teacher_logprobs: this MegatronPolicy was built without a teacher")
        return self._logprobs(self.teacher_models, micro_batches)

    def _logprobs(self, models: list[torch.nn.Module], micro_batches: list[dict[str, torch.Tensor]]):
        _check_micro_batches(micro_batches)
        with torch.no_grad():
            results = schedule.run(
                models, micro_batches,
                lambda logits, mb: token_logprobs(self._tempered(logits), mb["target_ids"], self.vocab_size),
                forward_only=True, packed=self.pack_sequences, before_forward=self._before_forward(models))
        return [_from_last_stage(results[i] if results else None, tuple(mb["target_ids"].shape))
                for i, mb in enumerate(micro_batches)]

    def _before_forward(self, models: list[torch.nn.Module]):
        """The schedule's hook for `models`: `pace()` (when set), then routing replay's targets on the policy's own
        models; None when there is neither."""
        routing = routing_replay_module.set_targets if self.routing_replay and models is self.models else None
        pace = self.pace
        if pace is None:
            return routing

        def before_forward(model, mb):
            pace()
            if routing is not None:
                routing(model, mb)
        return before_forward

    def _tempered(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.temperature == 1.0 else logits / self.temperature

    # ---- weights out

    def iter_hf_buckets(self, bucket_bytes: int, *, per_stage: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """HF-layout weight buckets: the whole model on global rank 0 (`per_stage=False`: the push path), or each
        pipeline stage's own tensors on its publisher rank (`per_stage=True`: the pull path's per-stage publishing);
        nothing elsewhere. See megatron_bridge.export. With LoRA: the adapters only, in PEFT's names, all on global
        rank 0 (`per_stage` must be False: an adapter version is one small file)."""
        if self.lora is None:
            return export.iter_hf_buckets(self.models, bucket_bytes, per_stage=per_stage)
        if per_stage:
            raise ValueError("LoRA adapters are published whole by global rank 0, not per pipeline stage")
        return export.iter_hf_buckets(self.models, bucket_bytes,
                                      mappings=adapters.adapter_mappings(self.info, self.lora))

    def adapter_config(self) -> dict | None:
        """The PEFT adapter_config.json of each published version (None without LoRA: versions are whole models)."""
        return adapters.peft_config(self.info, self.lora) if self.lora is not None else None

    def save_hf(self, out_dir: str | Path) -> Path | None:
        """An HF model directory written by global rank 0 (every tensor funnels to it); returns its path there,
        None elsewhere. With LoRA: the adapters merged into the base weights (W + alpha / r * B A)."""
        return export.save_hf(self.models, out_dir, merged=self.lora is not None)



def checkpoint_results_in_process() -> None:
    """Give megatron's checkpoint writer (filesystem_async) an in-process results queue before its first save.

    Contract: valid for synchronous saves only, which are all this module makes. `dist_checkpointing.save` runs the
    writer's `write_preloaded_data_multiproc` in the calling process: it forks one writer per bucket, gathers their
    results through its own fork queue and puts the dict on this queue, which `retrieve_write_results` then reads
    in the same process. Megatron's default is a `multiprocessing` manager started with "spawn" (built for async
    saves, where another process puts): a process per rank that imports torch to unpickle the results, and one
    that outlived a trainer killed with SIGKILL. Idempotent; a queue megatron already has is kept."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # heavy: megatron.core

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _frozen(models: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """`models` in eval mode with gradients off (the reference model)."""
    for model in models:
        model.eval()
        model.requires_grad_(False)
    return models


def _check_micro_batches(micro_batches: list[dict[str, torch.Tensor]], *, extra: tuple[str, ...] = ()) -> None:
    for i, mb in enumerate(micro_batches):
        missing = [k for k in ("input_ids", "target_ids", *extra) if k not in mb]
        if missing:
            raise ValueError(f"micro-batch {i}: needs {', '.join(missing)} (has {sorted(mb)})")
        if mb["target_ids"].shape != mb["input_ids"].shape:
            raise ValueError(f"micro-batch {i}: target_ids {tuple(mb['target_ids'].shape)} and input_ids "
                             f"{tuple(mb['input_ids'].shape)} differ in shape")


def distributed_optimizer_available() -> bool:
    """True when megatron's optimizer runs on TE's or Apex's fused Adam (checkpoint resharding of the
    distributed optimizer breaks on torch's AdamW in megatron-core 0.16.1, see the module docstring)."""
    from megatron.core.optimizer import distrib_optimizer

    return bool(distrib_optimizer.HAVE_APEX_OR_TE)


def _build_optimizer(models, *, lr: float, weight_decay: float, grad_clip: float, betas: tuple[float, float],
                     eps: float, dtype: str, distributed: bool, initial_loss_scale: float):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay,
                             adam_beta1=betas[0], adam_beta2=betas[1], adam_eps=eps, clip_grad=grad_clip,
                             bf16=dtype == "bfloat16", fp16=dtype == "float16",
                             params_dtype=getattr(torch, dtype), use_distributed_optimizer=distributed,
                             initial_loss_scale=initial_loss_scale)
    # On CPU the default process groups are gloo already; megatron's extra gloo groups are not created.
    optimizer = get_megatron_optimizer(config, models, use_gloo_process_groups=not device.is_installed())
    _fuse_cpu_adam(optimizer)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=lr, max_lr=lr, min_lr=lr, lr_warmup_steps=0,
                                        lr_decay_steps=1, lr_decay_style="constant", start_wd=weight_decay,
                                        end_wd=weight_decay, wd_incr_steps=1, wd_incr_style="constant")
    return optimizer, scheduler


def _torch_adams(optimizer) -> list[torch.optim.Optimizer]:
    """The torch Adam / AdamW optimizers inside megatron's optimizer (chained or not); none with TE's or Apex's."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [p.optimizer for p in parts
            if isinstance(getattr(p, "optimizer", None), (torch.optim.Adam, torch.optim.AdamW))]


def _fuse_cpu_adam(optimizer) -> None:
    """Run megatron's torch AdamW fallback by torch's fused kernel where its parameters are on the CPU.

    megatron builds `torch.optim.AdamW` without `fused`, and on CPU tensors torch then takes its per-tensor loop;
    fused, the same update is one vectorised pass (docs/benchmarks.md). The flag is a parameter group's, so a
    checkpoint's groups bring back theirs: `load_checkpoint` calls this again. The step counters of both paths are
    float32 CPU tensors, so a state saved by either loads into the other. GPU parameters are left to megatron (TE's
    or Apex's fused Adam in production)."""
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            if group["params"] and all(p.device.type == "cpu" for p in group["params"]):
                group["fused"], group["foreach"] = True, None


def _broadcast_names(names: list[str] | None) -> list[str]:
    """Metric names from the last pipeline stage to every stage (as UTF-8 JSON, not pickle)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return names or []
    payload = json.dumps(names or []).encode() if ps.is_pipeline_last_stage() else b""
    length = _from_last_stage(torch.tensor([len(payload)], dtype=torch.int64), (1,), dtype=torch.int64)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else None
    data = _from_last_stage(data, (int(length[0]),), dtype=torch.uint8)
    return json.loads(bytes(data.tolist()).decode())


def _from_last_stage(tensor: torch.Tensor | None, shape: tuple[int, ...], *,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`tensor` as held by the last pipeline stage, on every stage of this pipeline (CPU result)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        assert tensor is not None  # the only stage is the last
        return tensor.cpu()
    group = ps.get_pipeline_model_parallel_group()
    last = dist.get_process_group_ranks(group)[-1]
    if ps.is_pipeline_last_stage():
        assert tensor is not None  # the last stage holds it
        buffer = tensor.to(device.compute_device(), dtype).contiguous()
    else:
        buffer = torch.empty(shape, dtype=dtype, device=device.compute_device())
    dist.broadcast(buffer, src=last, group=group)
    return buffer.cpu()


def _on_every_rank(ok: bool) -> bool:
    """Collective over the whole world: True on every rank when `ok` is True on every rank."""
    flag = torch.tensor([0.0 if ok else 1.0], device=device.compute_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0
