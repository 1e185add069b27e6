"""Algorithm registry: `algorithm.name` -> an object with `advantages` and `loss_fn`.

A name is either a registered key (`grpo`, `rloo`, `reinforce_pp`, `gspo`, `cispo`, `dpo`, `sft`,
`on_policy_distill`, `chord`, `ppo`) or an import path
`package.module:object`, where the object is a class or factory called with the `AlgorithmConfig`. Either way
the result is checked against the `Algorithm` interface below, so a bad name fails when the run is built,
with a message that says what is wrong.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np
import torch

from rft.registry import Registry

if TYPE_CHECKING:
    from rft.config import AlgorithmConfig

MicroBatch = dict[str, torch.Tensor]  # the batch contract's micro-batch
Metrics = dict[str, torch.Tensor]


class Algorithm(Protocol):
    """What the trainer needs from an algorithm.

    - `advantages(rewards_per_group)`: one float32 array per group (same order, same lengths) from the rewards
      of whole groups. Called once per optimizer step with *all* groups of the step (some algorithms normalise
      over the whole batch).
    - `loss_fn(token_logprobs, micro_batch) -> (loss, metrics)`: per the batch contract, `loss` is this
      micro-batch's contribution to the step loss and every metric is a contribution to a step-wide sum.
    - `needs_reference`: the micro-batch must carry `ref_logprobs`.
    - `supports_replay`: the loss is correct on recorded experiences of any age (offline replay).
    - `pairwise` (optional, False when absent): rows are preference pairs, one group per pair; micro-batches keep
      both rows of a pair together and carry `pair_chosen` / `pair_index` (see rft/trainer/batch.py).
    - `needs_teacher` (optional, False when absent): the micro-batch must carry `teacher_logprobs` [b, T], the
      token log-probs of a frozen teacher model loaded from the algorithm's `teacher_path` (an HF directory with
      the policy's vocabulary), computed by the trainer on the recorded tokens.
    - `needs_demonstrations` (optional, False when absent): the step mixes demonstration rows in; micro-batches
      carry `demo_mask`, `global_demo_tokens`, `global_demo_sequences` and `step` (see rft/algorithms/chord.py);
      it then has `demonstrations_per_step` (demonstration groups the trainer adds to each step) and `mu(step)`.
    - `needs_critic` (optional, False when absent): the trainer keeps a value model (rft/algorithms/ppo.py), calls
      `add_targets(micro_batches, values, sum_over_replicas)` with its values before the step and trains it with
      `value_loss_fn(values, micro_batch)` in the same step; `critic_path` names its initial weights (None: the
      policy's).
    Every algorithm reports a `kl` metric: the trainer wraps `loss_fn` with `aggregation.with_kl_metric`.
    """
    name: str
    needs_reference: bool
    supports_replay: bool

    def advantages(self, rewards_per_group: Sequence[np.ndarray]) -> list[np.ndarray]: ...

    def loss_fn(self, token_logprobs: torch.Tensor, micro_batch: MicroBatch) -> tuple[torch.Tensor, Metrics]: ...


ALGORITHMS: Registry[Callable[["AlgorithmConfig"], Algorithm]] = Registry("algorithm", noun="algorithm")


def register(name: str):
    """Class decorator: make an algorithm selectable as `algorithm.name: <name>` (and set its `name`)."""
    def add(cls):
        ALGORITHMS.add(name, cls)
        cls.name = name
        return cls
    return add


def resolve_algorithm(name: str) -> Callable[["AlgorithmConfig"], Algorithm]:
    """The class or factory for `name` (a registered key or `pkg.mod:obj`); ValueError naming algorithm.name."""
    return ALGORITHMS.resolve(name, key="algorithm.name")


def build_algorithm(cfg: "AlgorithmConfig") -> Algorithm:
    """Instantiate the algorithm named by `cfg.name` with `cfg`, and check it has the `Algorithm` interface."""
    algorithm = resolve_algorithm(cfg.name)(cfg)
    missing = [attr for attr in ("advantages", "loss_fn", "needs_reference", "supports_replay")
               if not hasattr(algorithm, attr)]
    if missing:
        raise ValueError(f"algorithm.name: {cfg.name!r} built a {type(algorithm).__name__} without "
                         f"{', '.join(missing)} (see rft.algorithms.Algorithm)")
    return algorithm


def zero_advantages(rewards_per_group: Sequence[np.ndarray]) -> list[np.ndarray]:
    """`advantages` of algorithms whose loss ignores them (SFT, DPO): zeros of the right shapes."""
    return [np.zeros(len(r), dtype=np.float32) for r in rewards_per_group]
