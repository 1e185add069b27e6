"""The trainer's policy on a run's core board (rft/cores.py), applied once when the trainer is composed and only
where a board exists (CPU runs of `rft run`; never with GPUs). `CorePacedPolicy` fits torch's threads to the board
before each micro-batch's forward (the policy's `pace` hook, in the thread that computes) and adds their mean over
the step to `train_step`'s metrics as `cpu_threads`. The other half of the trainer's place on the board, waiting
while it is starved of experiences, is the experience feed's `busy` mark (rft/trainer/feed.py), on rank 0.
"""
from __future__ import annotations

from typing import Any

from rft.cores import CoreShare


class CorePacedPolicy:
    """`policy` (megatron_bridge.policy.MegatronPolicy, or anything with its `pace` hook and `train_step`), paced by
    `share`; every other attribute is the policy's own."""

    def __init__(self, policy: Any, share: CoreShare):
        self.policy, self.share = policy, share
        policy.pace = share.fit_torch

    def train_step(self, micro_batches: list[dict], loss_fn: Any) -> dict:
        """The policy's step, and `cpu_threads`: the mean thread count of the micro-batches since the last step."""
        return {**self.policy.train_step(micro_batches, loss_fn), "cpu_threads": self.share.mean_threads()}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)
