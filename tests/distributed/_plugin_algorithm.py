"""A new algorithm written in this one file, for tests/distributed/test_plugin_algorithm.py: a config selects it by
import path (`algorithm.name: tests.distributed._plugin_algorithm:Plugin`), its keys are `PluginOptions`, and it
declares every part the trainer can provide (`Needs`): the frozen reference, a teacher, a critic, demonstration
rows and the step. Nothing else in the repository names it.

The loss is a REINFORCE-style policy gradient on the policy's rows, -scale * A_i * logp_t, plus the negative
log-likelihood of the demonstration rows; the critic regresses the sample's reward. Its metrics report what the
trainer provided, as contributions to step-wide sums (the batch contract): `plugin_ref_gap` and
`plugin_teacher_gap` (token means of |logp - ref| and |logp - teacher|: 0 while the policy is the initial weights),
`plugin_step` (the micro-batches' `step`, over the step's sequences), `plugin_demo_rows` (demonstration rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rft.algorithms import Algorithm, Critic, Demonstrations, Needs
from rft.algorithms.aggregation import aggregate, check_micro_batch, token_metric
from rft.config import ConfigError

KEYS = ["loss_mask", "advantages", "ref_logprobs", "teacher_logprobs", "step", "demo_mask", "global_tokens",
        "global_sequences", "global_demo_tokens", "global_demo_sequences"]


@dataclass
class PluginOptions:
    scale: float = 1.0  # multiplies the advantages
    teacher_path: str = ""  # the teacher's HF directory
    demonstrations_per_step: int = 1  # demonstration groups in each step
    critic_lr: float = 1e-3  # the critic's learning rate

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ConfigError(f"algorithm.scale: must be > 0, got {self.scale}")


class Plugin(Algorithm):
    name = "plugin"
    Options = PluginOptions

    def __init__(self, options: PluginOptions):
        self.options = options
        self.needs = Needs(reference=True, teacher=options.teacher_path, step=True,
                           demonstrations=Demonstrations(groups_per_step=options.demonstrations_per_step),
                           critic=Critic(lr=options.critic_lr, add_targets=self.add_targets,
                                         value_loss_fn=self.value_loss_fn))

    def advantages(self, rewards_per_group):
        return [(np.asarray(r) - np.mean(r)).astype(np.float32) for r in rewards_per_group]

    def loss_fn(self, token_logprobs, micro_batch):
        check_micro_batch(token_logprobs, micro_batch, KEYS, algorithm=self.name)
        logp, demo = token_logprobs.float(), micro_batch["demo_mask"].float()[:, None]
        advantage = self.options.scale * micro_batch["advantages"].float()[:, None]
        per_token = -advantage * logp * (1 - demo) - logp * demo
        sequences = micro_batch["global_sequences"].clamp(min=1)
        real = (micro_batch["loss_mask"].sum(-1) > 0).float()
        metrics = {"plugin_ref_gap": token_metric((logp - micro_batch["ref_logprobs"]).abs(), micro_batch),
                   "plugin_teacher_gap": token_metric((logp - micro_batch["teacher_logprobs"]).abs(), micro_batch),
                   "plugin_step": (micro_batch["step"] * real).sum() / sequences,
                   "plugin_demo_rows": (micro_batch["demo_mask"] * real).sum()}
        return aggregate(per_token, micro_batch, "token_mean"), metrics

    def add_targets(self, micro_batches, values, sum_over_replicas):
        return [{**mb, "returns": mb["advantages"].float()[:, None].expand_as(v) * mb["loss_mask"]}
                for mb, v in zip(micro_batches, values, strict=True)]

    def value_loss_fn(self, values, micro_batch):
        loss = aggregate(0.5 * (values.float() - micro_batch["returns"]) ** 2, micro_batch, "token_mean")
        return loss, {"value_loss": loss.detach()}

    def step_metrics(self, step):
        return {"plugin_scale": self.options.scale * step}
