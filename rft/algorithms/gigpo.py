"""GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training"): GRPO's loss with a
per-token advantage that adds step-level credit to the episode-level one for multi-turn episodes.

For one group (one task's n episodes), each sample's `turns` (rft.schema.Turn: response tokens [start, end), the
key of the state the model acted from, the step's reward):
    A_E(i)    = GRPO's advantage of episode i's return (the sample's reward) in its group (std_normalize as grpo's)
    R_t(i)    = sum_{k >= t} gamma^(k - t) r_k(i)            discounted return-to-go of turn t of episode i
    A_S(i, t) = (R_t(i) - mean(G_s)) / (std(G_s) + eps)      G_s: the R of every turn of the group whose state key
                                                             is turn t's (an anchor state group; std with Bessel's
                                                             correction, left out with std_normalize: false);
                                                             0 for a state met only once in the group
    A(i, token) = A_E(i) + step_weight * A_S(i, t)  for the tokens of turn t;  A_E(i) for tokens outside any turn
A sample without turns gets A_E(i) on every token (plain GRPO). The loss is GRPO's clipped surrogate on the per-token
advantage (micro-batch key `token_advantages` [b, T]: `Needs.token_advantages`, rft/trainer/batch.py); `advantages`
stays A_E.

How a workflow fills `turns` (multi_turn does, for every environment; the hub adapters do the same): one Turn per
model turn, from the first token the model generated in it to the last token before its next turn (the
environment's reply, masked out of the loss, included), `state` a key that is equal exactly when two turns of a
group acted from the same environment state (FrozenLake: its board, where the player stands; by default a digest of
the observation the model saw), `reward` the environment's reward for that step (an episode scored only at its
end: its reward on the last turn).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rft.algorithms.grpo import ADVANTAGE_EPS, GRPO, GRPOOptions
from rft.algorithms.registry import Metrics, MicroBatch, Needs, register
from rft.config import Range, at_least, option

if TYPE_CHECKING:
    import torch

    from rft.schema import ExperienceGroup, Sample


@dataclass(frozen=True)
class GiGPOOptions(GRPOOptions):
    step_weight: float = option(1.0, range=at_least(0, "0: GRPO"),
        help="omega, the weight of the step advantage (among turns from the same state) added to the episode's")
    step_gamma: float = option(0.95, range=Range(0, 1),
        help="the discount of a turn's return-to-go over the following turns' rewards")


@register("gigpo", options=GiGPOOptions)
class GiGPO(GRPO):
    extra_keys = ("token_advantages",)

    def __init__(self, options: GiGPOOptions):
        super().__init__(options)
        self.options = options
        self.needs = Needs(reference=options.kl_coef > 0, token_advantages=True)

    def token_advantages(self, groups: Sequence[ExperienceGroup]) -> list[list[np.ndarray]]:
        """Per group, per sample: one float32 advantage per response token (the module docstring)."""
        episode = self.advantages([g.rewards for g in groups])
        return [self._group_tokens(g, a) for g, a in zip(groups, episode, strict=True)]

    def _group_tokens(self, group: ExperienceGroup, episode: np.ndarray) -> list[np.ndarray]:
        returns = [self._returns_to_go(s) for s in group.samples]
        anchors: dict[str, list[float]] = defaultdict(list)
        for sample, ret in zip(group.samples, returns, strict=True):
            for turn, r in zip(sample.turns or [], ret, strict=True):
                anchors[turn.state].append(r)
        out = []
        for sample, ret, a_e in zip(group.samples, returns, episode, strict=True):
            tokens = np.full(len(sample.response_tokens), float(a_e), dtype=np.float64)
            for turn, r in zip(sample.turns or [], ret, strict=True):
                tokens[turn.start:turn.end] += self.options.step_weight * self._step_advantage(r, anchors[turn.state])
            out.append(tokens.astype(np.float32))
        return out

    def _returns_to_go(self, sample: Sample) -> list[float]:
        returns, running = [], 0.0
        for turn in reversed(sample.turns or []):
            running = turn.reward + self.options.step_gamma * running
            returns.append(running)
        return returns[::-1]

    def _step_advantage(self, value: float, anchor: list[float]) -> float:
        if len(anchor) < 2:
            return 0.0
        centred = value - float(np.mean(anchor))
        return centred / (float(np.std(anchor, ddof=1)) + ADVANTAGE_EPS) if self.cfg.std_normalize else centred

    def policy_loss(self, logp: torch.Tensor, micro_batch: MicroBatch, prox: torch.Tensor,
                    weight: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        return self.clipped_surrogate(logp, micro_batch, prox, weight, micro_batch["token_advantages"].float())
