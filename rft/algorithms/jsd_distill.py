"""JSD distillation (Trinity-RFT's `jsd` advantage): on_policy_distill with the per-token reverse-KL estimate replaced
by Trinity-RFT's per-token beta-mixture Jensen-Shannon term between the student's and the teacher's log-probabilities
of the sampled token (s_t = logp_t at the weights the step starts from, detached; t_t = teacher_t):

    beta = 0:      j_t = s_t - t_t                       (the reverse-KL estimate: on_policy_distill's k_t)
    beta = 1:      j_t = t_t - s_t                       (Trinity-RFT's forward-KL case)
    0 < beta < 1:  m_t = log(beta e^t_t + (1 - beta) e^s_t)
                   j_t = beta (t_t - m_t) + (1 - beta) (s_t - m_t)
    A_it = distill_reward_coef * A_i - distill_coef * j_t,   then GRPO's clipped surrogate (on_policy_distill's loss)

As Trinity-RFT defines it (trinity/algorithm/advantage_fn/jsd_advantage.py, its log-space version): the endpoints are
special cases, not the limits of the mixture term (which tends to 0 as beta -> 0 or 1), and at beta = 0.5 the term is
symmetric in s and t (<= 0: every token with a gap gets a positive advantage). docs/algorithms.md says when to use it.
Keys: on_policy_distill's plus `jsd_beta`. Metrics: on_policy_distill's (`teacher_kl`, the mean of s - t), plus
`teacher_jsd`, the token mean of j_t.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rft.algorithms.aggregation import token_metric
from rft.algorithms.on_policy_distill import DistillOptions, OnPolicyDistill
from rft.algorithms.registry import Metrics, MicroBatch, register
from rft.config import Range, option
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")


@dataclass(frozen=True)
class JSDOptions(DistillOptions):
    """on_policy_distill's keys and the mixture weight."""
    jsd_beta: float = option(0.5, range=Range(0, 1),
        help="jsd_distill: the teacher's weight in the mixture; 0: the reverse-KL estimate (on_policy_distill), "
        "1: Trinity-RFT's forward-KL case, 0.5: the symmetric JSD")


def jsd_per_token(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """j_t of the module docstring, elementwise, in log space."""
    if beta == 0:
        return student - teacher
    if beta == 1:
        return teacher - student
    mixture = torch.logaddexp(teacher + math.log(beta), student + math.log1p(-beta))
    return beta * (teacher - mixture) + (1 - beta) * (student - mixture)


@register("jsd_distill", options=JSDOptions)
class JSDDistill(OnPolicyDistill):
    cfg: JSDOptions

    def policy_loss(self, logp: torch.Tensor, micro_batch: MicroBatch, prox: torch.Tensor,
                    weight: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        mask = micro_batch["loss_mask"] > 0
        student, teacher = logp.detach(), micro_batch["teacher_logprobs"].float()
        gap = torch.where(mask, student - teacher, 0.0)
        jsd = torch.where(mask, jsd_per_token(student, teacher, self.cfg.jsd_beta), 0.0)
        advantage = (self.cfg.distill_reward_coef * micro_batch["advantages"].float()[:, None]
                     - self.cfg.distill_coef * jsd)
        per_token, metrics = self.clipped_surrogate(logp, micro_batch, prox, weight, advantage)
        return per_token, {**metrics, "teacher_kl": token_metric(gap, micro_batch),
                           "teacher_jsd": token_metric(jsd, micro_batch)}
