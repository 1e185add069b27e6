"""`MegatronCritic`: a value model for PPO — the HF causal LM's transformer (a megatron GPTModel built and loaded like
the policy's, sharded at the same TP/PP layout) with its vocabulary output layer replaced by a scalar value head.

Values: V[i, t] (float32 [b, T]) is the head applied to the final-norm hidden state at position t, the state in which
the policy scores target token t, so values line up with `token_logprobs` and the loss mask.

Value head: a linear map hidden -> 1 (weight [1, hidden], bias [1]) on the last pipeline stage only (the other stages
end in hidden states, as the policy's do), replicated on every tensor-parallel rank: the hidden states it reads are the
same on all of them (no sequence parallelism), so its output and its gradients are too, and megatron counts a replicated
parameter once in the gradient norm. Its weight starts as normal(0, 1 / sqrt(hidden)) drawn from a generator seeded with
`head_seed` (the same numbers on every rank and layout), its bias at 0. The trunk's tied output embedding (if any) is no
longer an output layer: the critic is built untied, so megatron does not all-reduce embedding gradients between the
first and last stages.

Training: its own megatron optimizer and learning rate (a second DDP + optimizer beside the policy's, on the
parallel groups the policy set up: build the policy first), one optimizer step per `train_step`; checkpoints are
the policy's format (megatron dist_checkpointing, reshardable) in a directory of their own. Every method is
collective over all ranks, like MegatronPolicy's.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import megatron_bridge.parallel as parallel
import megatron_bridge.schedule as schedule
from megatron_bridge.model import build_model
from megatron_bridge.policy import TrainedModel, _check_micro_batches, _from_last_stage

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

ValueLossFn = Callable[[torch.Tensor, dict], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


class ValueHead(torch.nn.Module):
    """Stands in for GPTModel's output layer: [s, b, hidden] -> ([s, b, 1], None), the output layer's signature."""

    def __init__(self, hidden: int, *, seed: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        # named weight / bias like the output layer it replaces (megatron's checkpoint code looks them up by name)
        self.weight = torch.nn.Parameter((torch.randn(1, hidden, generator=generator) / math.sqrt(hidden))
                                         .to(device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype))

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def add_value_head(model: GPTModel, *, seed: int) -> GPTModel:
    """`model` (a GPTModel chunk from build_model) with its output layer replaced by a `ValueHead` on the last stage
    and embedding/output tying switched off on every stage; returns it."""
    model.share_embeddings_and_output_weights = False
    if model.post_process:
        model.output_layer = ValueHead(model.config.hidden_size, seed=seed, dtype=model.config.params_dtype,
                                       device=next(model.parameters()).device)
    return model


class MegatronCritic(TrainedModel):
    """A scalar value per position on batch-contract micro-batches (module docstring)."""

    kind = "critic"

    def __init__(self, hf_dir: str | Path, *, lr: float, weight_decay: float = 0.0, grad_clip: float = 1.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, dtype: str = "float32",
                 head_seed: int = 0, initial_loss_scale: float = 2.0 ** 16):
        if lr <= 0:
            raise ValueError(f"critic: need lr > 0, got {lr}")
        self.layout = parallel.layout()
        models = [add_value_head(m, seed=head_seed) for m in build_model(hf_dir, dtype=dtype)]
        self._train(models, lr=lr, weight_decay=weight_decay, grad_clip=grad_clip, betas=betas, eps=eps, dtype=dtype,
                    initial_loss_scale=initial_loss_scale)

    def values(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """V [b, T] (float32, CPU) for each micro-batch, without gradients, on every rank of this replica."""
        _check_micro_batches(micro_batches)
        for model in self.models:
            model.eval()
        with torch.no_grad():
            results = schedule.run(self.models, micro_batches, lambda out, mb: out[..., 0].float(), forward_only=True)
        return [_from_last_stage(results[i] if results else None, tuple(mb["input_ids"].shape))
                for i, mb in enumerate(micro_batches)]

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], loss_fn: ValueLossFn) -> dict[str, float]:
        """One optimizer step of `loss_fn(values [b, T] float32, micro_batch) -> (loss contribution, metrics)` over
        this DP rank's micro-batches (the batch contract); metrics summed over micro-batches and data-parallel
        ranks, with the critic's `grad_norm` and `step_skipped`, on every rank."""
        return self._optimizer_step(micro_batches, lambda out, mb: loss_fn(out[..., 0].float(), mb))

    def close(self) -> None:
        """Nothing: the parallel state belongs to the policy, whose `close` tears it down."""
