"""PPO with a critic (the RLHF form): GAE advantages from a learned value model instead of group statistics, GRPO's
clipped surrogate per token, and a clipped value loss for the critic.

Positions: everything is [b, T] in the batch contract's layout, position t scoring target token t; V_t is the value
of the state before response token t. Row i's response is its loss tokens in order (t_1 < ... < t_n with m_t = 1;
masked tokens, e.g. tool output, are skipped). Rewards: r_i on the last response token, 0 elsewhere; the batch's
per-sample `advantages` channel carries r_i and the trainer turns it into per-token targets once the critic's
values are known (`add_targets`).
GAE over a row's response tokens, k = n..1, with V_{t_{n+1}} = 0 and A_{n+1} = 0:
    delta_k = r_k + gamma * V_{t_{k+1}} - V_{t_k}      A_k = delta_k + gamma * lam * A_{k+1}      R_k = A_k + V_{t_k}
`algorithm.whiten_advantages`: A <- (A - mean) / (std + eps) over all loss tokens of the step (every micro-batch, every
DP rank; population std); returns stay unwhitened.
Policy loss: GRPO's (rft/algorithms/grpo.py) with A_t in place of A_i (the KL stays a loss term).
Value loss (the critic's, its own optimizer, same step), V_old from `add_targets`, eps_v = `algorithm.value_clip`:
    v_t = 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old_t - eps_v, V_old_t + eps_v) - R_t)^2)
(value_clip null: 0.5 (V_t - R_t)^2), reduced by `algorithm.loss_agg`, so micro-batch and DP splits change neither.
Micro-batch keys after `add_targets`: `values` (V_old), `returns` (R), `token_advantages` (A), float32 [b, T], 0
outside the loss mask.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rft.algorithms.aggregation import aggregate, check_micro_batch, token_metric
from rft.algorithms.grpo import GRPO, GRPOOptions, finite_rewards
from rft.algorithms.registry import Critic, Metrics, MicroBatch, Needs, register
from rft.config import POSITIVE, PROBABILITY, Range, option
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")

WHITEN_EPS = 1e-8


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both float32 [b, T] and 0 outside `mask`, for rewards [b] (each on its row's last loss
    token), values [b, T] and mask [b, T]; the recursion of the module docstring, vectorised over rows. Rows are
    independent: any split of the rows gives the same numbers."""
    # NumPy float64 on CPU: the loop runs once per position, where small numpy operations are cheapest
    v = values.detach().double().cpu().numpy()
    active = (mask > 0).cpu().numpy()
    final_reward = rewards.detach().double().cpu().numpy()
    advantages = np.zeros(v.shape)
    next_value = np.zeros(v.shape[0])      # V at the following loss token (0 after the last)
    next_adv = np.zeros(v.shape[0])
    seen = np.zeros(v.shape[0], dtype=bool)  # a later loss token exists in the row
    for t in range(v.shape[1] - 1, -1, -1):
        on = active[:, t]
        delta = np.where(seen, 0.0, final_reward) + gamma * next_value - v[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = np.where(on, adv, 0.0)
        next_value = np.where(on, v[:, t], next_value)
        next_adv = np.where(on, adv, next_adv)
        seen |= on
    returns = np.where(active, advantages + v, 0.0)
    return torch.from_numpy(advantages).float(), torch.from_numpy(returns).float()


def token_moments(tensors: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """[count, sum, sum of squares] (float64) of the masked entries of `tensors`: summed over data-parallel ranks
    they give the step-wide mean and variance."""
    out = torch.zeros(3, dtype=torch.float64)
    for x, m in zip(tensors, masks, strict=True):
        x, m = x.double(), (m > 0).double()
        out += torch.stack([m.sum(), (x * m).sum(), (x * x * m).sum()])
    return out


@dataclass(frozen=True)
class PPOOptions(GRPOOptions):
    """GRPO's keys (the policy loss) and the critic's."""
    gamma: float = option(1.0, range=PROBABILITY, help="GAE discount per response token")
    lam: float = option(0.95, range=PROBABILITY,
        help="GAE lambda (1: Monte-Carlo returns minus values; 0: one-step TD)")
    value_clip: float | None = option(0.2, range=Range(low=0, low_open=True, note="null: no clipping"),
        help="the value loss clips V to V_old +- value_clip; null: unclipped")
    whiten_advantages: bool = option(True,
        help="normalise GAE advantages to mean 0, std 1 over the step's loss tokens")
    critic_lr: float = option(1.0e-5, range=POSITIVE, help="the critic's own Adam learning rate")
    critic_path: str = option("",
        help="HF directory the critic's trunk starts from; empty: model.path (the policy's)")


@register("ppo", options=PPOOptions)
class PPO(GRPO):
    cfg: PPOOptions
    extra_keys = ("token_advantages",)

    def __init__(self, options: PPOOptions):
        super().__init__(options)
        # None: the critic's trunk starts from the policy's model.path
        self.needs = Needs(reference=self.needs.reference, critic=Critic(
            lr=options.critic_lr, path=options.critic_path or None, add_targets=self.add_targets,
            value_loss_fn=self.value_loss_fn))

    def advantages(self, rewards_per_group: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The rewards themselves (the per-sample channel carries r_i to `add_targets`; see the module docstring)."""
        return [finite_rewards(r, i).astype(np.float32) for i, r in enumerate(rewards_per_group)]

    def add_targets(self, micro_batches: list[MicroBatch], values: list[torch.Tensor],
                    sum_over_replicas: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> list[MicroBatch]:
        """The micro-batches with `values`, `returns` and `token_advantages` added (module docstring). `values[k]`
        is the critic's V [b, T] on micro-batch k before the step; `sum_over_replicas` sums a float64 tensor over
        data-parallel ranks (identity with one rank): whitening uses step-wide moments."""
        out, advantages = [], []
        for k, (mb, v) in enumerate(zip(micro_batches, values, strict=True)):
            if tuple(v.shape) != tuple(mb["loss_mask"].shape):
                raise ValueError(f"ppo: values of micro-batch {k} have shape {tuple(v.shape)}, loss_mask "
                                 f"{tuple(mb['loss_mask'].shape)}")
            adv, ret = gae(mb["advantages"], v, mb["loss_mask"], gamma=self.cfg.gamma, lam=self.cfg.lam)
            advantages.append(adv)
            out.append({**mb, "values": torch.where(mb["loss_mask"] > 0, v.float(), 0.0), "returns": ret})
        if self.cfg.whiten_advantages:
            count, total, squares = sum_over_replicas(token_moments(advantages, [mb["loss_mask"] for mb in out]))
            mean = total / count.clamp(min=1)
            std = (squares / count.clamp(min=1) - mean * mean).clamp(min=0).sqrt()
            advantages = [torch.where(mb["loss_mask"] > 0, ((a - mean) / (std + WHITEN_EPS)).float(), 0.0)
                          for a, mb in zip(advantages, out, strict=True)]
        return [{**mb, "token_advantages": a} for mb, a in zip(out, advantages, strict=True)]

    def policy_loss(self, logp: torch.Tensor, micro_batch: MicroBatch, prox: torch.Tensor,
                    weight: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        return self.clipped_surrogate(logp, micro_batch, prox, weight, micro_batch["token_advantages"].float())

    def value_loss_fn(self, values: torch.Tensor, micro_batch: MicroBatch) -> tuple[torch.Tensor, Metrics]:
        """The critic's loss contribution of this micro-batch (batch contract) for the current values [b, T], and
        metrics (step-wide sums): `value_loss`, `value_clip_frac` (tokens where the clipped term is the larger),
        `value_mean`, `return_mean`."""
        check_micro_batch(values, micro_batch, ["loss_mask", "values", "returns", "global_tokens",
                                                "global_sequences"], algorithm=f"{self.name} value")
        v, old, ret = values.float(), micro_batch["values"].float(), micro_batch["returns"].float()
        unclipped = (v - ret) ** 2
        if self.cfg.value_clip is None:
            per_token, clipped_more = 0.5 * unclipped, torch.zeros_like(v)
        else:
            eps = self.cfg.value_clip
            clipped = (torch.clamp(v, old - eps, old + eps) - ret) ** 2
            per_token, clipped_more = 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()
        loss = aggregate(per_token, micro_batch, self.loss_agg)
        return loss, {"value_loss": loss.detach(), "value_clip_frac": token_metric(clipped_more, micro_batch),
                      "value_mean": token_metric(v, micro_batch), "return_mean": token_metric(ret, micro_batch)}
