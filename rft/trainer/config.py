"""The trainer's sections: `trainer` (parallelism, batching, optimizer, checkpoints), `replay_buffer` (prioritised
replay of earlier groups) and `replay` (offline training from a recorded topic)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rft.config import COUNT, OPTIONAL, POSITIVE, SEED, Range, Section, SectionError, at_least, option


@dataclass(frozen=True)
class TrainerConfig(Section):
    KEY = "trainer"
    tensor_parallel: int = option(1, range=COUNT,
        help="megatron tensor parallelism: ranks each layer's weights are split over")
    pipeline_parallel: int = option(1, range=COUNT,
        help="megatron pipeline parallelism: consecutive stages the layers are split into (each on tensor_parallel"
        " ranks)")
    data_parallel: int = option(1, range=COUNT,
        help="model replicas; the trainer runs tensor_parallel x pipeline_parallel x data_parallel processes (`rft"
        " run` starts them, a hand-written launch must match)")
    expert_parallel: int = option(1, range=COUNT,
        help="megatron expert parallelism (mixtures of experts): each MoE layer's experts are split over this many"
        " of the data_parallel ranks (which keep replicating attention and the other dense weights); must "
        "divide data_parallel")
    moe_aux_loss_coeff: float = option(0.0, range=at_least(0, "0: off"),
        help="MoE router load-balancing (switch) loss coefficient; 0: off. Logged per step as "
        "moe_load_balancing_loss")
    moe_z_loss_coeff: float = option(0.0, range=at_least(0, "0: off"),
        help="MoE router z-loss coefficient; 0: off. Logged per step as moe_z_loss")
    micro_batch_size: int = option(8, range=COUNT,
        help="rows per micro-batch (fixed shape); not used when max_tokens_per_micro_batch > 0")
    max_tokens_per_micro_batch: int = option(0, range=OPTIONAL,
        help="> 0: micro-batches by token budget, rows grouped by length (rows x own longest row <= budget; "
        "pipeline_parallel 1); 0: fixed micro_batch_size")
    share_prompts: bool = option(True,
        help="the trainer runs the rows of a micro-batch that share a prompt (a group's samples) as one sequence "
        "with the prompt once; same loss and gradients, fewer positions; megatron's local layer spec, dense "
        "models, pipeline_parallel 1 (else rows run padded, as the trainer's first log line says)")
    pack_sequences: bool = option(False,
        help="concatenate each micro-batch's rows into one sequence (PackedSeqParams, thd); needs Transformer "
        "Engine on a GPU and pipeline_parallel 1")
    lr: float = option(1e-5, range=POSITIVE,
        help="Adam learning rate of the policy, constant for the whole run (no warm-up, no decay); > 0")
    weight_decay: float = option(0.0, range=at_least(0),
        help="Adam's decoupled weight decay, not applied to biases and norm weights; 0: none")
    grad_clip: float = option(1.0, range=OPTIONAL,
        help="gradients are clipped to this global L2 norm before each optimizer step (critic's too); 0: no "
        "clipping")
    adam_beta1: float = option(0.9, range=Range(0, 1, high_open=True),
        help="Adam's decay of the gradient's running mean (policy and critic)")
    adam_beta2: float = option(0.999, range=Range(0, 1, high_open=True),
        help="Adam's decay of the squared gradient's running mean (policy and critic)")
    checkpoint_every: int = option(10, range=COUNT,
        help="steps between checkpoints (model, optimizer and consumed Kafka offsets: a restarted trainer resumes "
        "from the newest); the last step is always checkpointed")
    poll_timeout_s: float = option(600.0, range=POSITIVE,
        help="seconds the trainer waits without a new experience record before it fails (FeedTimeout), e.g. when "
        "every explorer is gone")
    min_scored_samples: int = option(2, range=COUNT,
        help="a group that lost rollouts to failures (a sample's `failure`: docs/schema.md, \"Failed rollouts\") "
        "trains on its scored samples when at least min(this, its size) are left, else it is dropped and counted "
        "(skipped too_few_scored); 2: a group baseline (a mean and a std) needs two")
    operators: list[Any] = option(factory=list,
        help="experience operators, in order: names or {name: ..., args} (docs/data.md)")
    mismatch_ratio: float = option(2.0, range=Range(low=1, low_open=True),
        help="the training-inference mismatch logged every step counts in logprob_mismatch_frac the tokens whose "
        "trainer / rollout probability ratio is outside [1/mismatch_ratio, mismatch_ratio] "
        "(rft/algorithms/mismatch.py)")
    staleness_policy: str = option("in_order",
        help="which admitted groups a step takes: in_order (as they arrive), oldest_version_first (oldest policy "
        "version in the pool first), windowed (policy_version within [v - staleness_window, v], older evicted), or "
        "package.module:Class (rft/experience/staleness_policies.py); the mode's staleness bound holds for all")
    staleness_pool: int = option(0, range=OPTIONAL,
        help="groups read ahead that the policy chooses a step's groups from (held ones are checkpointed by "
        "offset); 0: run.groups_per_step. At most (admission bound + 1) x run.groups_per_step with explorers "
        "that wait at admission")
    staleness_window: int = option(1, range=at_least(0),
        help="windowed: k, the versions behind the trainer's a group may be; at least ceil(pool / "
        "run.groups_per_step) - 1")
    borrow_cores: bool = option(True,
        help="CPU runs of `rft run` (no GPUs, OMP_NUM_THREADS unset): the trainer and the explorers on this "
        "machine take the threads of those that wait (rft/cores.py; the trainer's logged per step as "
        "cpu_threads); false: fixed threads")

    def validate(self) -> None:
        """Token-budget micro-batches and packed sequences vary the activation shape from micro-batch to micro-batch,
        which megatron's pipeline schedule (fixed shape per step) cannot send between stages; experts are split over
        data-parallel ranks."""
        if self.max_tokens_per_micro_batch and self.pipeline_parallel != 1:
            raise SectionError("max_tokens_per_micro_batch",
                               f"needs trainer.pipeline_parallel 1 (the pipeline schedule sends one activation shape "
                               f"per step), got pipeline_parallel {self.pipeline_parallel}; set it to 0")
        if self.pack_sequences and self.pipeline_parallel != 1:
            raise SectionError("pack_sequences", f"needs trainer.pipeline_parallel 1, got {self.pipeline_parallel}")
        if self.data_parallel % self.expert_parallel:
            raise SectionError("expert_parallel", f"must divide trainer.data_parallel ({self.data_parallel}): the "
                              f"experts are split over data-parallel ranks, got {self.expert_parallel}")


@dataclass(frozen=True)
class ReplayBufferConfig(Section):
    """Prioritised replay: each step also re-trains on earlier groups, re-read from the experiences topic by offset
    (rft/trainer/replay_buffer.py)."""
    KEY = "replay_buffer"
    groups_per_step: int = option(0, range=OPTIONAL,
        help="replayed groups per step, on top of run.groups_per_step fresh ones; 0: off")
    max_reuse: int = option(1, help="times one group may be replayed after its fresh use", range=COUNT)
    priority: str = option("reward_variance",
        help="reward_variance, uniform, or package.module:function(group) -> score >= 0")
    decay: float = option(0.9, range=Range(0, 1, low_open=True),
        help="recency: priority = score x decay^(steps since the group trained fresh), in (0, 1]")
    capacity: int = option(1024, range=COUNT,
        help="candidates remembered (metadata only, not records); beyond it the oldest are forgotten")
    seed: int | None = option(None, help="of the weighted choice; null: run.seed", range=SEED)


@dataclass(frozen=True)
class ReplayConfig(Section):
    """Offline training (`run.mode: offline`, `rft replay`) from a recorded experiences topic."""
    KEY = "replay"
    topic: str = option("", help="empty: this run's experiences topic")
    start: str = option("", help="P:O[,P:O...] offsets, an ISO 8601 time, or epoch ms; empty: the topic's beginning")
    end: str = option("", help="exclusive, same forms; empty: the topic's end when the replay starts")
    from_data: bool = option(False,
        help="first fill an empty topic with `data`'s (prompt, answer) rows as one-sample groups ("
        "demonstrations, rft/data/demonstrations.py)")


def pool_problem(*, policy: str, pool: int, window: int, groups_per_step: int,
                 admission_bound: int | None) -> tuple[str, str] | None:
    """(the trainer key, why) when a feed with this staleness policy cannot make progress, else None. `pool`:
    trainer.staleness_pool (0: groups_per_step); `admission_bound`: the staleness the explorers' admission holds
    them to (None: they do not wait, or the run has no explorers).

    - the pool must hold a step's groups (pool >= groups_per_step): the step picks them from it;
    - explorers that wait at admission bound a produce at most (a + 1) x groups_per_step groups the trainer has not
      trained (rft/explorer/admission.py's formula), so a larger pool never fills: the trainer waits for groups the
      explorers wait to be allowed to start (a deadlock);
    - windowed: a group read into a full pool waits ceil(pool / groups_per_step) - 1 steps for its turn, ageing one
      version a step; a window k below that evicts groups before their turn;
    - in_order does not choose: its pool is one step's.
    """
    effective = pool or groups_per_step
    ahead = None if admission_bound is None else (admission_bound + 1) * groups_per_step
    wait = -(-effective // groups_per_step) - 1
    if policy == "in_order" and effective != groups_per_step:
        return "staleness_pool", (
            f"in_order takes groups as they arrive: staleness_pool must be 0 (run.groups_per_step), got {pool}; a "
            f"larger pool needs a policy that chooses (oldest_version_first, windowed, a plugin)")
    if effective < groups_per_step:
        return "staleness_pool", (
            f"the pool ({pool}) must hold a step's run.groups_per_step ({groups_per_step}) groups: a step picks them "
            f"from it")
    if ahead is not None and effective > ahead:
        return "staleness_pool", (
            f"the explorers' admission lets at most (bound {admission_bound} + 1) x run.groups_per_step "
            f"{groups_per_step} = {ahead} groups run ahead of the trainer, so a pool of {effective} never fills (the "
            f"trainer would wait for groups the explorers wait to start); lower it, or raise the mode's bound")
    if policy == "windowed" and window < wait:
        return "staleness_window", (
            f"windowed with a pool of {effective} groups (run.groups_per_step {groups_per_step}): a group waits up to "
            f"{wait} steps for its turn, so staleness_window must be >= {wait}, got {window}")
    return None
