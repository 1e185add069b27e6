"""On-policy distillation (Agarwal et al. 2024 "GKD"; Thinking Machines 2025): a teacher scores the student's samples.

The student samples as in any RL run; the trainer runs a frozen teacher (`algorithm.teacher_path`, any HF directory
the bridge loads, with the student's vocabulary) over the recorded tokens, and every response token gets the
per-token reverse-KL estimate
    k_t = logp_t - teacher_t          (log pi_student(y_t) - log pi_teacher(y_t), y_t drawn from the student)
The loss is GRPO's clipped surrogate with the per-token advantage
    A_it = distill_reward_coef * A_i  -  distill_coef * sg(k_t)         (A_i: GRPO's group advantage of sample i)
    l_t  = -w_t * min(rho_t A_it, clip(rho_t, 1 - eps_low, 1 + eps_high) A_it)  +  kl_coef * k3_t
reduced by `algorithm.loss_agg`; rho, prox, w, the clip range and the reference-KL term are GRPO's
(rft/algorithms/grpo.py). sg is stop-gradient; k_t is taken at the current policy detached (teacher == student
gives k = 0 exactly). At rho = 1 the gradient is the score-function gradient of KL(pi_student || pi_teacher)
(mode-seeking). With distill_reward_coef = 0 (the default) rewards are logged but not trained on.

Needs the micro-batch key `teacher_logprobs` [b, T] (`needs.teacher`). Replay: as GRPO's (`off_policy_correction`).
Metrics: GRPO's, plus `teacher_kl`, the token mean of k_t.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rft.algorithms.aggregation import token_metric
from rft.algorithms.grpo import GRPO, GRPOOptions
from rft.algorithms.registry import Metrics, MicroBatch, Needs, register
from rft.config import ConfigError, at_least, option
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")


@dataclass(frozen=True)
class DistillOptions(GRPOOptions):
    """GRPO's keys (the clipped surrogate) and the teacher's."""
    teacher_path: str = option("",
        help="required: the teacher's HF model directory (same vocabulary as model.path)")
    distill_coef: float = option(1.0, range=at_least(0), help="weight of the per-token advantage -(logp - teacher)")
    distill_reward_coef: float = option(0.0, range=at_least(0, "0: none"),
        help="weight of the reward (GRPO group) advantage; 0: none")


@register("on_policy_distill", options=DistillOptions)
class OnPolicyDistill(GRPO):
    cfg: DistillOptions
    extra_keys = ("teacher_logprobs",)

    def __init__(self, options: DistillOptions):
        super().__init__(options)
        if not options.teacher_path:
            raise ConfigError("algorithm.teacher_path: on_policy_distill needs the teacher's Hugging Face model "
                              "directory (same tokenizer and vocabulary as model.path)")
        if options.distill_coef == 0 and options.distill_reward_coef == 0:
            raise ConfigError("algorithm.distill_coef: with distill_reward_coef also 0 the loss is 0; set one > 0")
        self.needs = Needs(reference=self.needs.reference, teacher=options.teacher_path)

    def policy_loss(self, logp: torch.Tensor, micro_batch: MicroBatch, prox: torch.Tensor,
                    weight: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        mask = micro_batch["loss_mask"] > 0
        gap = torch.where(mask, logp.detach() - micro_batch["teacher_logprobs"].float(), 0.0)  # k_t
        advantage = (self.cfg.distill_reward_coef * micro_batch["advantages"].float()[:, None]
                     - self.cfg.distill_coef * gap)
        per_token, metrics = self.clipped_surrogate(logp, micro_batch, prox, weight, advantage)
        return per_token, {**metrics, "teacher_kl": token_metric(gap, micro_batch)}
