"""Algorithm registry: `algorithm.name` -> an algorithm class, its typed options, and what it needs from the trainer.

A name is a registered key (`grpo`, `rloo`, `reinforce_pp`, `reinforce`, `gspo`, `cispo`, `sapo`, `topr`, `sppo`,
`opmd`, `asymre`, `rec`, `raft`, `remax`, `m2po`, `clip_b`, `clip_v`, `dpo`, `sft`, `on_policy_distill`, `jsd_distill`,
`chord`, `ppo`, `gigpo`) or an import path
`package.module:Class`. An algorithm is written in one file:

    @dataclass
    class MyOptions:                      # the keys of `algorithm:` besides `name`, with their defaults
        beta: float = 0.1  # what beta does

    @register("my_algo", options=MyOptions)
    class MyAlgo(Algorithm):
        def __init__(self, options: MyOptions):
            self.options = options
            self.needs = Needs(reference=True)        # what the trainer must provide (below)
        def advantages(self, rewards_per_group): ...
        def loss_fn(self, token_logprobs, micro_batch): ...

The section's other keys are built into `Options` by `rft.config.build_section` (errors name `algorithm.<key>`).
The trainer and launcher know no algorithm by name: they provide what `algorithm.needs` (a `Needs`) declares.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rft.algorithms.config import AlgorithmConfig
from rft.config import build_section
from rft.lazy import lazy
from rft.registry import Registry

if TYPE_CHECKING:
    import torch

    from rft.schema import ExperienceGroup

else:  # imported by the first loss computed, not by a config check (rft/lazy.py)
    torch = lazy("torch")

MicroBatch = dict[str, "torch.Tensor"]  # the batch contract's micro-batch
Metrics = dict[str, "torch.Tensor"]
LossFn = Callable[["torch.Tensor", MicroBatch], "tuple[torch.Tensor, Metrics]"]


@dataclass(frozen=True)
class Critic:
    """A value model the trainer keeps beside the policy (megatron_bridge.critic, the policy's TP/PP layout). Each
    step, before the policy's optimizer step, the trainer calls `add_targets(micro_batches, values,
    sum_over_replicas)` with the critic's values [b, T] on every micro-batch (`sum_over_replicas` sums a float64
    tensor over the data-parallel ranks) and trains on the micro-batches it returns; then the critic takes its own
    optimizer step on `value_loss_fn(values, micro_batch)` (the batch contract). It is checkpointed with the policy
    (`<step dir>/critic`)."""
    lr: float  # the critic's own Adam learning rate
    add_targets: Callable[[list[MicroBatch], list[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]],
                          list[MicroBatch]]
    value_loss_fn: LossFn
    path: str | None = None  # HF directory the critic's trunk starts from; None: the policy's model.path
    key: str = "algorithm.critic_path"  # the config key that sets `path` (named in errors)


@dataclass(frozen=True)
class Demonstrations:
    """Demonstration groups mixed into every step: up to `groups_per_step` one-sample groups from `topic`, read up to
    the topic's end when the trainer starts (rft/data/demonstrations.py writes them; `rft run` fills an empty topic
    from `data`). They become rows with `demo_mask` 1 (rft/trainer/batch.py); their offsets are checkpointed."""
    groups_per_step: int
    topic: str = ""  # empty: the run's `<run>.demonstrations`

    def topic_of(self, run_topic: str) -> str:
        """The topic the demonstrations are read from: `topic`, else `run_topic` (the run's `<run>.demonstrations`)."""
        return self.topic or run_topic


SumOverReplicas = Callable[["torch.Tensor"], "torch.Tensor"]  # a float64 CPU tensor summed over the DP ranks


@dataclass(frozen=True)
class StepStart:
    """A pass over all of a step's micro-batches before its loss, for algorithms that decide per token from the whole
    optimizer batch (M2PO's second-moment mask, Clip_B / Clip_V's entropy clipping). The trainer runs the policy
    forward without gradients at the weights the step starts from and adds to every micro-batch [b, T] float32:
    `start_logprobs` (log-probs of the recorded tokens), with `entropy` `start_entropy` (the entropy of the tempered
    distribution at each loss position), with `collision` `start_collision` (sum_v p_v^2 (log p_v + H) there; both 0
    outside `loss_mask`); then it trains on `prepare(micro_batches, sum_over_replicas)`, called on every rank with
    that rank's micro-batches, where `sum_over_replicas` sums a float64 CPU tensor over the data-parallel ranks (a
    collective: every rank calls it the same number of times). One step is one optimizer update, so the start's
    log-probs equal the loss's `token_logprobs` in value."""
    prepare: Callable[[list[MicroBatch], SumOverReplicas], list[MicroBatch]]
    entropy: bool = False
    collision: bool = False


@dataclass(frozen=True)
class Needs:
    """What an algorithm needs the trainer to provide; the default needs nothing. Each is a micro-batch key (the
    batch contract, rft/trainer/batch.py) or a part the trainer runs:
    - `reference`: `ref_logprobs` [b, T], the token log-probs of the frozen initial policy;
    - `teacher`: `teacher_logprobs` [b, T] of a frozen teacher loaded from this HF directory (the policy's vocabulary),
      computed on the recorded tokens; `teacher_key` is the config key that sets it (named in errors);
    - `critic`: a value model (`Critic`);
    - `demonstrations`: demonstration rows in every step (`Demonstrations`): micro-batches carry `demo_mask`,
      `global_demo_tokens` and `global_demo_sequences`, and the step logs `demonstrations` (their count);
    - `pairwise`: rows are preference pairs, one group per pair: groups that are not pairs are skipped (and counted),
      micro-batches keep both rows of a pair together and carry `pair_chosen` / `pair_index`;
    - `step`: micro-batches carry `step`, the optimizer step being taken (from 1);
    - `step_start`: a pass over the step's micro-batches at its starting weights, then the algorithm's `prepare`
      (`StepStart`);
    - `greedy_baseline`: every group carries `greedy_reward`, the reward of one greedy response to its task that the
      explorer generated beside the samples (explorer.greedy_baseline, turned on by this need); a group without one
      is dead-lettered by the trainer's check; advantages come from `baseline_advantages`;
    - `token_advantages`: micro-batches carry `token_advantages` [b, T] float32, one advantage per response token
      from the algorithm's `token_advantages(groups)` (0 outside the response; rows without one, e.g.
      demonstrations, get their `advantages` on every response token)."""
    reference: bool = False
    teacher: str | None = None
    teacher_key: str = "algorithm.teacher_path"
    critic: Critic | None = None
    demonstrations: Demonstrations | None = None
    pairwise: bool = False
    step: bool = False
    step_start: StepStart | None = None
    greedy_baseline: bool = False
    token_advantages: bool = False


@dataclass
class NoOptions:
    """The options of an algorithm that takes no keys besides `name`."""


class Algorithm:
    """What the trainer needs from an algorithm, with the defaults of the optional parts (subclass it).

    - `advantages(rewards_per_group)`: one float32 array per group (same order, same lengths) from the rewards
      of whole groups. Called once per optimizer step with *all* groups of the step (some algorithms normalise
      over the whole batch).
    - `loss_fn(token_logprobs, micro_batch) -> (loss, metrics)`: per the batch contract, `loss` is this
      micro-batch's contribution to the step loss and every metric is a contribution to a step-wide sum.
    - `baseline_advantages(rewards_per_group, baselines)`: instead of `advantages` when `needs.greedy_baseline`:
      `baselines` holds each group's `greedy_reward` (finite, in the run's reward range).
    - `token_advantages(groups)`: when `needs.token_advantages`: per group (ExperienceGroups of the step), per
      sample, a float32 array of one advantage per response token (multi-turn credit: gigpo.py).
    - `needs`: what the trainer provides (`Needs`; default: nothing).
    - `supports_replay`: the loss is correct on recorded experiences of any age (offline replay, replayed groups).
    - `step_metrics(step)`: values the trainer logs with step `step` besides the loss's metrics (default: none).
    - `Options`: the dataclass the `algorithm:` keys besides `name` are built into (set by `register`).
    Every algorithm reports a `kl` metric: the trainer wraps `loss_fn` with `aggregation.with_kl_metric`.
    """
    name: str = ""
    Options: type = NoOptions
    needs: Needs = Needs()
    supports_replay: bool = False

    def advantages(self, rewards_per_group: Sequence[np.ndarray]) -> list[np.ndarray]:
        raise NotImplementedError

    def baseline_advantages(self, rewards_per_group: Sequence[np.ndarray],
                            baselines: Sequence[float]) -> list[np.ndarray]:
        raise NotImplementedError

    def loss_fn(self, token_logprobs: torch.Tensor, micro_batch: MicroBatch) -> tuple[torch.Tensor, Metrics]:
        raise NotImplementedError

    def token_advantages(self, groups: Sequence[ExperienceGroup]) -> list[list[np.ndarray]]:
        raise NotImplementedError

    def step_metrics(self, step: int) -> dict[str, float]:
        return {}


INTERFACE = ("advantages", "loss_fn", "needs", "supports_replay", "step_metrics")

# How to train on recorded experiences when an algorithm cannot as configured (error messages)
REPLAY_HINT = "set algorithm.off_policy_correction: true, or use sft or dpo"

ALGORITHMS: Registry[type] = Registry("algorithm", noun="algorithm")


def register(name: str, *, options: type = NoOptions):
    """Class decorator: make an algorithm selectable as `algorithm.name: <name>` with the keys of the dataclass
    `options` (sets the class's `name` and `Options`)."""
    def add(cls):
        ALGORITHMS.add(name, cls)
        cls.name, cls.Options = name, options
        return cls
    return add


def resolve_algorithm(name: str) -> type:
    """The class for `name` (a registered key or `pkg.mod:Class`); ValueError naming algorithm.name."""
    return ALGORITHMS.resolve(name, key="algorithm.name")


def options_type(cls: Any) -> type:
    """The options dataclass of an algorithm class (`NoOptions` for an import-path object that declares none)."""
    return cls.Options if isinstance(cls, type) and issubclass(cls, Algorithm) else getattr(cls, "Options", NoOptions)


def option_keys(name: str) -> frozenset[str]:
    """The keys the algorithm `name` takes besides `name` (its options' fields); ValueError naming algorithm.name."""
    return frozenset(f.name for f in dataclasses.fields(options_type(resolve_algorithm(name))))


def build_options(cfg: AlgorithmConfig, *, source: str = "<config>", prefix: str = "algorithm") -> Any:
    """The typed options of the algorithm `cfg.name` from the section's other keys; ConfigError naming `source`
    and `<prefix>.<key>` for an unknown key, a wrong type or a value out of range."""
    return build_section(options_type(resolve_algorithm(cfg.name)), cfg.options, source=source, prefix=prefix)


def build_algorithm(cfg: AlgorithmConfig, *, source: str = "<config>") -> Algorithm:
    """Instantiate the algorithm named by `cfg.name` with its options, and check it has the `Algorithm` interface."""
    cls = resolve_algorithm(cfg.name)
    algorithm = cls(build_section(options_type(cls), cfg.options, source=source, prefix="algorithm"))
    missing = [attr for attr in INTERFACE if not hasattr(algorithm, attr)]
    if missing:
        raise ValueError(f"algorithm.name: {cfg.name!r} built a {type(algorithm).__name__} without "
                         f"{', '.join(missing)} (see rft.algorithms.Algorithm)")
    if not isinstance(algorithm.needs, Needs):
        raise ValueError(f"algorithm.name: {cfg.name!r}: `needs` is a {type(algorithm.needs).__name__}, not an "
                         "rft.algorithms.Needs")
    if algorithm.needs.token_advantages and not hasattr(algorithm, "token_advantages"):
        raise ValueError(f"algorithm.name: {cfg.name!r} needs per-token advantages but has no token_advantages "
                         "(see rft.algorithms.Algorithm)")
    if algorithm.needs.greedy_baseline and not hasattr(algorithm, "baseline_advantages"):
        raise ValueError(f"algorithm.name: {cfg.name!r} needs a greedy baseline but has no baseline_advantages "
                         "(see rft.algorithms.Algorithm)")
    return algorithm


def group_advantages(algorithm: Algorithm, groups: Sequence[ExperienceGroup]) -> list[np.ndarray]:
    """The advantages of `groups` (ExperienceGroups) by `algorithm`: `advantages` of their rewards, or, when it needs
    a greedy baseline, `baseline_advantages` with each group's `greedy_reward` (ValueError naming a group without)."""
    rewards = [g.rewards for g in groups]
    if not algorithm.needs.greedy_baseline:
        return algorithm.advantages(rewards)
    baselines = []
    for g in groups:
        if g.greedy_reward is None:
            raise ValueError(f"advantages: group {g.group_id} has no greedy_reward, which algorithm "
                             f"{algorithm.name!r} subtracts")
        baselines.append(float(g.greedy_reward))
    return algorithm.baseline_advantages(rewards, baselines)


def zero_advantages(rewards_per_group: Sequence[np.ndarray]) -> list[np.ndarray]:
    """`advantages` of algorithms whose loss ignores them (SFT, DPO): zeros of the right shapes."""
    return [np.zeros(len(r), dtype=np.float32) for r in rewards_per_group]
