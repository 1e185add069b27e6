"""`rft trainer CONFIG`: the Megatron trainer, one process per rank (torchrun or srun). This module is the trainer
process's composition (the one reader of the root config: `build_trainer`, `open_trainer_io`) and its loop.

`Trainer.run`, per step s (policy version s-1 -> s):
  1. global rank 0 takes `run.groups_per_step` whole groups from the experiences topic (rft/trainer/feed.py: dead
     letters, duplicates and groups too stale for the mode are skipped), plus replayed ones (`replay_buffer`) and
     demonstrations when the algorithm needs them, and broadcasts their raw bytes to every rank;
  2. every rank computes advantages and its data-parallel share of micro-batches (rft/trainer/batch.py; a
     vision-language model's rows get their pixels from the processor each rank re-runs: rft/trainer/images.py); the
     policy (and a critic, when needed) runs one optimizer step;
  3. version s goes out to the explorers (rft/trainer/weights.py `WeightSync`: its docstring is the order);
  4. every `trainer.checkpoint_every` steps: model, optimizer, the offsets consumed and the replay buffer
     (exactly-once resume), then metrics; once committed, rank 0 collects claim-checked parts no reader needs any
     more, in the background (`records.collect`, rft/trainer/collect.py).
The trainer knows no algorithm by name: it provides what the algorithm declares in `algorithm.needs`
(rft.algorithms.Needs: reference or teacher log-probs, demonstrations, the step, preference pairs, a critic, a pass
over the step's micro-batches before its loss), and
only that. Resume: the newest complete checkpoint is loaded and the feed seeks to its offsets; `consumed.jsonl` (which
group trained in which step) is cut back to that step, so that it always describes the effective run. Rank 0 claims
the weight store's lineage first (rft.weights.store.claim_lineage: the checkpoint's, continued; a used store without
one is refused unless `sync.new_lineage`) and checkpoints its id. Before a checkpoint commits, every file it holds is
synced and the dead letters sent since the last one are flushed and checked (`TrainerIO.flush_dead_letters`).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rft.algorithms import Critic, Demonstrations, Needs, StepStart, build_algorithm, group_advantages
from rft.algorithms.aggregation import with_kl_metric
from rft.algorithms.config import AlgorithmConfig
from rft.algorithms.mismatch import with_mismatch_metrics
from rft.cli.commandline import add_config_arguments, config_from_args, die_with_parent
from rft.config import ConfigError
from rft.cores import CoreShare
from rft.experience.operators import OperatorContext, build_operator_chain, split_drops
from rft.experience.staleness_policies import build_staleness_policy
from rft.models.config import ModelConfig
from rft.models.moe import moe_shape
from rft.models.vision import is_vision_model
from rft.modes import mode, staleness
from rft.observability.metrics import MetricsLogger
from rft.observability.prometheus import MetricsEndpoint, metrics_endpoint
from rft.processes import durable_replace, sync_tree, write_durably
from rft.run.config import Config, RunConfig
from rft.run.records import run_transport
from rft.schema import FAILURE_CLASSES, ExperienceGroup, ImageLimits, RewardRange, decode_group
from rft.trainer import distributed as dist_io
from rft.trainer.batch import (
    TrainableLimits,
    plan_micro_batches,
    preference_pair_problem,
    replayed_fraction,
    rows_from_groups,
)
from rft.trainer.checkpoint import CheckpointDir, TrainerState, capture_rng, restore_rng
from rft.trainer.collect import Collector
from rft.trainer.config import TrainerConfig
from rft.trainer.feed import EndOfReplay, ExperienceFeed, FeedState, ReplayWindow, open_feed, resolve_window
from rft.trainer.images import ImagePrompts, image_prompts
from rft.trainer.pacing import CorePacedPolicy
from rft.trainer.replay_buffer import ExperienceReplay, Replayed, open_replay
from rft.trainer.staleness import StalenessTracker
from rft.trainer.weights import WeightSync
from rft.transport import RecordSink, Transport, TransportError, lag
from rft.transport.control import KEEP_METRIC, Kind, TrainerFinished, TrainerStarted, TrainerStep, TrainerWaiting
from rft.weights.config import SyncConfig
from rft.weights.publisher import WeightPublisher
from rft.weights.store import LineageError, WeightStoreError, claim_lineage
from rft.weights.stores import open_store
from rft.weights.vllm_transfer import push_transport

WAIT_ANNOUNCE_S = 2.0
KEEP_WINDOW = 4  # steps over which keep_fraction (the share of fresh groups kept) is measured


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft trainer", description="Run the trainer (one process per rank).")
    add_config_arguments(parser)
    parser.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    args = parser.parse_args(argv)
    os.umask(0o077)  # checkpoints, metrics, weights: directories 0700, files 0600
    cfg = config_from_args(args, joins_broker="rft trainer")
    # megatron's checkpoint writer forks helper processes; a trainer killed mid-checkpoint must not leave them behind
    os.register_at_fork(after_in_child=lambda: die_with_parent(signal.SIGKILL))
    try:
        trainer = build_trainer(cfg, resume=not args.no_resume)
    except ConfigError as e:
        print(f"rft trainer: invalid config: {e}", file=sys.stderr)
        return 2
    except LineageError as e:
        print(f"rft trainer: {e}", file=sys.stderr)
        return 2
    try:
        trainer.run()
    finally:
        trainer.close()
    return 0


def build_trainer(cfg: Config, *, resume: bool = True) -> Trainer:
    """Compose a Trainer from the root config: its sections, the behaviour policy's temperature, the run's core board
    (CPU runs of `rft run` only: rft/trainer/pacing.py) and rank 0's Kafka side (`open_trainer_io`)."""
    cores = CoreShare.from_environment()  # None: no core board (GPUs, OMP_NUM_THREADS chosen, no `rft run`)
    return Trainer(cfg.trainer, run=cfg.run, model=cfg.model, algorithm=cfg.algorithm, sync=cfg.sync,
                   run_dir=cfg.run_dir, temperature=cfg.explorer.temperature or 1.0,  # 0 = greedy: untempered
                   progress=cfg.monitor.progress, resume=resume, cores=cores,
                   open_io=lambda feed_state, replay_state: open_trainer_io(cfg, feed_state=feed_state,
                                                                           replay_state=replay_state, cores=cores))


@dataclass
class TrainerIO:
    """Rank 0's side of the run: the experience feed (and its dead-letter sink), the replay buffer, the control
    sink, the metrics, and the weight publisher (it announces on `control`; the trainer's `WeightSync` delivers
    through it, flushes and closes it). Built by `open_trainer_io`; closed by the trainer, after its WeightSync."""
    feed: ExperienceFeed
    dead_letter_sink: RecordSink
    control: RecordSink
    control_topic: str
    experiences_topic: str
    metrics: MetricsLogger
    prometheus: MetricsEndpoint | None
    announce: Callable[[Kind], None]  # sends one control message and waits until the broker has it
    publisher: WeightPublisher
    replay: ExperienceReplay | None = None
    # opens the demonstrations feed at a checkpointed state (None when the algorithm needs none)
    demonstrations_opener: Callable[[FeedState], tuple[ExperienceFeed, RecordSink]] | None = None
    demonstrations: ExperienceFeed | None = None
    demonstrations_sink: RecordSink | None = None
    collector: Collector | None = None  # records.collect after each checkpoint commit (rft/trainer/collect.py)
    # a vision-language model's processor, shared by the feeds' checks and rank 0's rows (rft/trainer/images.py)
    images: ImagePrompts | None = None

    def open_demonstrations(self, state: FeedState) -> None:
        assert self.demonstrations_opener is not None, "the algorithm needs no demonstrations"
        self.demonstrations, self.demonstrations_sink = self.demonstrations_opener(state)

    def flush_dead_letters(self) -> None:
        """Every dead letter the feeds sent is on the topic (TransportError otherwise): called before a checkpoint
        commits the offsets past their records, so that a failed copy is never lost with its record consumed."""
        self.feed.dead_letter.flush()
        if self.demonstrations is not None:
            self.demonstrations.dead_letter.flush()

    def close(self) -> None:
        if self.collector is not None:
            self.collector.close()
        if self.prometheus is not None:
            self.prometheus.close()
        self.metrics.close()
        self.control.close()
        self.dead_letter_sink.close()
        self.feed.source.close()
        if self.replay:
            self.replay.reader.close()
        if self.demonstrations is not None:
            self.demonstrations.source.close()
        if self.demonstrations_sink is not None:
            self.demonstrations_sink.close()


def open_trainer_io(cfg: Config, *, feed_state: FeedState, replay_state: dict, transport: Transport | None = None,
                    cores: CoreShare | None = None) -> TrainerIO:
    """Open rank 0's side of the run from the root config, resuming the feed at `feed_state` and the replay buffer
    from `replay_state`; `transport` defaults to the run's Kafka with its claim store (`run_transport(cfg)`);
    `cores`: the run's core board, on which the feed marks the trainer waiting while it is starved (rft/cores.py)."""
    transport = transport or run_transport(cfg)
    needs = build_algorithm(cfg.algorithm).needs
    images = image_prompts(cfg.model.path, ImageLimits.of(cfg.data))  # None: a text model
    offline = cfg.run.mode == "offline"
    topic = (cfg.replay.topic or cfg.topic("experiences")) if offline else cfg.topic("experiences")
    feed, dlq_sink, _ = open_feed(
        transport, topic=topic, dead_letter_topic=cfg.topic("dead_letter"),
        run_id=None if offline else cfg.run.name, state=feed_state, client_id=f"{cfg.run.name}-trainer",
        window=_replay_window(cfg, transport, topic) if offline else None, operators=build_operator_chain(
            cfg.trainer.operators, OperatorContext(cfg.model.tokenizer or cfg.model.path)),
        check=trainable_limits(cfg, greedy_baseline=needs.greedy_baseline, images=images).problem,
        busy=cores.set_busy if cores is not None else None,
        policy=build_staleness_policy(cfg.trainer.staleness_policy, window=cfg.trainer.staleness_window),
        pool=cfg.trainer.staleness_pool, min_scored=cfg.trainer.min_scored_samples)
    replay = None
    if cfg.replay_buffer.groups_per_step:
        replay = open_replay(cfg.replay_buffer, run_seed=cfg.run.seed, state=replay_state, claims=transport.claims,
                             topic_source=lambda: transport.source(client_id=f"{cfg.run.name}-trainer-replay"))
    control = transport.sink(client_id=f"{cfg.run.name}-trainer")
    control_topic = cfg.topic("control")

    def announce(message: Kind) -> None:
        control.send_record(control_topic, message.to_message())
        control.flush()

    publisher = WeightPublisher(cfg.sync, store=open_store(cfg.sync, cfg.run_dir), announce=announce,
                                hf_dir=cfg.model.path,
                                push_members=cfg.explorer.replicas * cfg.explorer.tensor_parallel_size,
                                transport=push_transport(cfg.sync, cfg.explorer, lora=cfg.model.lora.rank > 0))
    io = TrainerIO(feed=feed, dead_letter_sink=dlq_sink, replay=replay, control=control, control_topic=control_topic,
                   experiences_topic=topic, metrics=MetricsLogger(cfg.run_dir, cfg.monitor, run_name=cfg.run.name),
                   prometheus=metrics_endpoint(cfg.monitor, run=cfg.run.name, role="trainer", instance="0"),
                   announce=announce, publisher=publisher, collector=Collector(cfg, transport), images=images)
    demonstrations = needs.demonstrations
    if demonstrations is not None:
        demonstrations_topic = demonstrations.topic_of(cfg.topic("demonstrations"))
        io.demonstrations_opener = lambda state: _open_demonstrations(cfg, demonstrations_topic, transport, state,
                                                                      images)
    return io


def trainable_limits(cfg: Config, *, greedy_baseline: bool = False,
                     images: ImagePrompts | None = None) -> TrainableLimits:
    """The limits a group must meet to be trained on in this run: the model's vocabulary (its config.json's, a
    vision-language model's `text_config`'s), the length limits, the reward range; with `greedy_baseline` (the
    algorithm's need), a `greedy_reward`; with routing replay (`run.routing_replay`), routed experts of the model's
    MoE layout (its config.json); samples with images: `images`, the vision-language model's processor
    (rft/trainer/images.py; None: images are refused)."""
    hf_config = Path(cfg.model.path) / "config.json"
    try:
        config = json.loads(hf_config.read_text())
        config = config.get("text_config") or config  # a vision-language model's language model
        vocab_size = int(config["vocab_size"])
        moe = moe_shape(config) if cfg.run.routing_replay else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"model.path: {hf_config} has no readable vocab_size or MoE layout: {e}") from None
    return TrainableLimits(vocab_size=vocab_size, max_prompt_len=cfg.model.max_prompt_len,
                           max_response_len=cfg.model.max_response_len, rewards=RewardRange.of(cfg.run),
                           greedy_baseline=greedy_baseline, moe=moe, images=images)


def _open_demonstrations(cfg: Config, topic: str, transport: Transport, state: FeedState,
                         images: ImagePrompts | None = None) -> tuple[ExperienceFeed, RecordSink]:
    """The feed of demonstration groups (any run's) on `topic`, up to the topic's end now, resuming at `state`; and
    its dead-letter sink."""
    source = transport.source()
    try:
        window = resolve_window(source, topic)
    finally:
        source.close()
    feed, sink, _ = open_feed(transport, topic=topic, dead_letter_topic=cfg.topic("dead_letter"), run_id=None,
                              state=state, window=window, client_id=f"{cfg.run.name}-trainer-demonstrations",
                              check=trainable_limits(cfg, images=images).problem)
    return feed, sink


def _replay_window(cfg: Config, transport: Transport, topic: str) -> ReplayWindow:
    """Resolved on the first start and saved, so a resumed replay reads the same records."""
    path = cfg.run_dir / "replay_window.json"
    if path.exists():
        return ReplayWindow.from_json(json.loads(path.read_text()))
    source = transport.source()
    try:
        window = resolve_window(source, topic, start=cfg.replay.start, end=cfg.replay.end)
    finally:
        source.close()
    write_durably(path, json.dumps({"topic": topic, **window.to_json()}))
    return window


def build_policy(t: TrainerConfig, *, run: RunConfig, model: ModelConfig, needs: Needs, temperature: float):
    """The policy (megatron_bridge's MegatronPolicy) at the trainer's layout, with the frozen models `needs` asks for;
    `temperature`: the behaviour policy's (its log-probs are tempered alike)."""
    from megatron_bridge.packing import packing_supported  # heavy: torch
    from megatron_bridge.policy import MegatronPolicy  # heavy: megatron.core, torch.distributed

    if t.pack_sequences and is_vision_model(model.path):
        raise ConfigError(f"trainer.pack_sequences: {model.path} is a vision-language model, and packed sequences do "
                          "not take images; set it to false")
    if t.pack_sequences and not packing_supported():
        raise ConfigError("trainer.pack_sequences: needs Transformer Engine on a GPU (megatron's packed 'thd' "
                          "attention), and transformer_engine is not importable or no GPU is present here; "
                          "set it to false")
    return MegatronPolicy(
        model.path, tp=t.tensor_parallel, pp=t.pipeline_parallel, ep=t.expert_parallel, lr=t.lr,
        weight_decay=t.weight_decay, moe_aux_loss_coeff=t.moe_aux_loss_coeff, moe_z_loss_coeff=t.moe_z_loss_coeff,
        grad_clip=t.grad_clip, betas=(t.adam_beta1, t.adam_beta2), seed=run.seed, dtype=model.dtype,
        reference=needs.reference, temperature=temperature, pack_sequences=t.pack_sequences,
        teacher=needs.teacher, routing_replay=run.routing_replay, lora=model.lora, share_prompts=t.share_prompts)


def build_critic(need: Critic, t: TrainerConfig, *, model: ModelConfig, seed: int):
    """The value model of `needs.critic`: megatron_bridge.critic at the policy's layout, from the need's path or
    else the policy's `model.path`, with its own learning rate and the trainer's other optimizer settings."""
    from megatron_bridge.critic import MegatronCritic  # heavy: megatron.core, torch.distributed

    return MegatronCritic(need.path or model.path, lr=need.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                          betas=(t.adam_beta1, t.adam_beta2), dtype=model.dtype, head_seed=seed)


class Trainer:
    """The loop of the module docstring, on every rank. It takes the config sections it uses; `open_io(feed_state,
    replay_state)` opens rank 0's Kafka side (a TrainerIO) once the checkpoint to resume from is loaded;
    `temperature` is the explorers' sampling temperature (the behaviour policy's). `policy` is the model
    (`build_policy` when not given: the unit tests of the loop pass a stand-in with the same methods); `cores`: the
    run's core board (None without one), which paces the policy (rft/trainer/pacing.py)."""

    def __init__(self, trainer: TrainerConfig, *, run: RunConfig, model: ModelConfig, algorithm: AlgorithmConfig,
                 sync: SyncConfig, run_dir: Path, temperature: float, progress: bool,
                 open_io: Callable[[FeedState, dict], TrainerIO], resume: bool = True, policy: Any = None,
                 cores: CoreShare | None = None):
        self.config, self.run_config, self.model = trainer, run, model
        self.run_dir, self.progress = Path(run_dir), progress
        check_parallel_layout(trainer, dist_io.world_size())
        self.algorithm = build_algorithm(algorithm)
        self.needs: Needs = self.algorithm.needs
        # `kl` and the training-inference mismatch (rft.algorithms.mismatch) are logged whatever the algorithm
        self.loss_fn = with_mismatch_metrics(with_kl_metric(self.algorithm.loss_fn), ratio=trainer.mismatch_ratio)
        policy = policy or build_policy(trainer, run=run, model=model, needs=self.needs, temperature=temperature)
        self.policy = CorePacedPolicy(policy, cores) if cores is not None else policy
        critic = self.needs.critic
        self.critic = build_critic(critic, trainer, model=model, seed=run.seed) if critic is not None else None
        self.staleness = StalenessTracker(mode=run.mode, max_staleness=run.max_staleness)
        self.is_reader = dist_io.rank() == 0
        if self.is_reader:
            print(f"[trainer] {self.policy.describe()}", flush=True)
        self.checkpoints = CheckpointDir(self.run_dir)
        state = self._resume() if resume else None
        self.step, self.counters = (state.step, state.counters) if state else (0, {"samples": 0.0})
        self._last_checkpoint = self.step
        self._demos: list[ExperienceGroup] = []  # this step's demonstration groups (needs.demonstrations)
        self._replayed: list[Replayed] = []  # rank 0: this step's replayed groups
        self._failed: dict[str, int] = {}  # rank 0: this step's failed samples per failure class (Batch.failed)
        self._reuse: list[int] = []  # rank 0: per group of this step, how often it was trained before
        # rank 0: (fresh groups kept, dropped) of recent steps (_keep_fraction)
        self._kept: collections.deque[tuple[int, int]] = collections.deque(maxlen=KEEP_WINDOW)
        self.io: TrainerIO | None = None
        self.replay: ExperienceReplay | None = None  # rank 0's replay buffer (replay_buffer.groups_per_step > 0)
        self.lineage = state.lineage if state else ""  # the weight store's lineage id (rank 0, checkpointed)
        if self.is_reader:
            io = open_io(state.feed if state else FeedState(), state.replay_buffer if state else {})
            if mode(run.mode).publishes_weights:
                try:
                    self.lineage = claim_lineage(io.publisher.store, run.name, checkpoint=self.lineage,
                                                 resumed=state is not None, resume=resume, new=sync.new_lineage).id
                except WeightStoreError:
                    io.close()
                    raise
            self._open_io(io, FeedState.from_json(state.demonstrations if state else {}))
        # a vision-language model's processor (rank 0: the feeds', whose checks already ran it on this step's prompts)
        self.images = self.io.images if self.io is not None else image_prompts(model.path)
        self.weights = WeightSync(self.policy, sync, self.run_dir, publisher=self.io.publisher if self.io else None,
                                  offsets=(lambda: dict(self.feed.state.offsets)) if self.io else None,
                                  lora=bool(model.lora.rank), publishes=mode(run.mode).publishes_weights)

    def _resume(self) -> TrainerState | None:
        """Load the newest complete checkpoint (policy, critic, RNG); its trainer state, None without one."""
        latest = self.checkpoints.latest()
        if latest is None:
            return None
        state = self.checkpoints.read_state(latest)
        self.policy.load_checkpoint(latest / "model")
        if self.critic is not None:
            self.critic.load_checkpoint(latest / "critic")
        restore_rng(state.rng)
        return state

    # -- rank 0's Kafka side
    def _open_io(self, io: TrainerIO, demonstrations_state: FeedState) -> None:
        self.io, self.feed, self.replay = io, io.feed, io.replay
        if self.needs.demonstrations is not None:
            io.open_demonstrations(demonstrations_state)
        self.consumed_path = self.run_dir / "consumed.jsonl"
        self._last_wait_note = 0.0
        _truncate_consumed(self.consumed_path, self.step)
        io.announce(TrainerStarted(step=self.step, version=self.step, offsets=dict(self.feed.state.offsets),
                                   prometheus_port=io.prometheus.port if io.prometheus else None))

    @property
    def reader(self) -> TrainerIO:
        """Rank 0's side of the run (only rank 0 reads, announces and logs)."""
        assert self.io is not None, "rank 0 only"
        return self.io

    def _waiting(self, groups_so_far: int) -> None:
        """While starved, tell the explorers what has been consumed (admission control reads it)."""
        now = time.monotonic()
        if now - self._last_wait_note >= WAIT_ANNOUNCE_S:
            self._last_wait_note = now
            self.reader.announce(TrainerWaiting(version=self.step, offsets=dict(self.feed.state.offsets),
                                                groups_in_batch=groups_so_far))

    # -- the loop
    def run(self) -> None:
        if self.step == 0:
            self.weights.publish(0)  # explorers start from version 0 = the initial weights
        while self.step < self.run_config.max_steps:
            step = self.step + 1
            started = time.time()
            groups, skipped, exhausted = self._next_groups(step)
            if not groups:
                break
            metrics = self._train(step, groups)
            self.step = step
            count_skipped_step(self.counters, metrics)
            self.weights.publish(step)  # version `step`, out before the next step (WeightSync)
            if step % self.config.checkpoint_every == 0:
                self._checkpoint(step)
            if self.is_reader:
                self._log(step, groups, skipped, metrics, started)
            if exhausted:
                break
        if self.step != self._last_checkpoint:
            self._checkpoint(self.step)  # the last step, when the loop did not just checkpoint it
        self._export_final()
        self.weights.flush()
        if self.is_reader:
            self.reader.announce(TrainerFinished(step=self.step))

    def _next_groups(self, step: int) -> tuple[list[ExperienceGroup], dict[str, int], bool]:
        """This step's groups on every rank, the skip counts (rank 0), and whether a replay is exhausted."""
        skipped: dict[str, int] = {}
        raw, exhausted = None, False
        if self.is_reader:
            replayed = self.replay.replay(step) if self.replay else []  # chosen before this step's fresh groups
            waiting_since = time.time()
            try:
                batch = self.feed.next_batch(self.run_config.groups_per_step, admit=lambda g: self._admit(g, step),
                                             version=step - 1, timeout_s=self.config.poll_timeout_s,
                                             on_wait=self._waiting)
            except EndOfReplay as end:
                batch, exhausted = end.batch, True
            for g in batch.groups:
                self.staleness.used(step=step, policy_version=g.policy_version, n_samples=len(g.samples))
            self._data_wait_s = time.time() - waiting_since
            if self.replay:
                self.replay.remember(step, batch.messages, batch.groups)
            self._replayed = replayed
            self._reuse = [0] * len(batch.messages) + [r.reuse for r in replayed]
            raw = [m.value for m in batch.messages] + [r.message.value for r in replayed]
            skipped = dict(batch.skipped)
            self._failed = dict(batch.failed)
        groups = [decode_group(value) for value in dist_io.broadcast_bytes(raw)]
        if self.needs.demonstrations is not None:
            self._demos = self._next_demonstrations(self.needs.demonstrations)
        return groups, skipped, dist_io.broadcast_flag(exhausted)

    def _next_demonstrations(self, need: Demonstrations) -> list[ExperienceGroup]:
        """Collective: this step's demonstration groups on every rank, from a feed bounded by its topic's end when the
        trainer started (none once it is used up); its offsets are checkpointed with the experiences'."""
        raw = None
        if self.is_reader:
            assert self.reader.demonstrations is not None, "opened by _open_io"
            try:
                batch = self.reader.demonstrations.next_batch(need.groups_per_step,
                                                              timeout_s=self.config.poll_timeout_s)
            except EndOfReplay as end:
                batch = end.batch
            raw = [m.value for m in batch.messages]
        return [decode_group(value) for value in dist_io.broadcast_bytes(raw)]

    def _admit(self, group: ExperienceGroup, step: int) -> str | None:
        """The feed's admission: None to train on `group`, else the reason it is skipped (and counted)."""
        if self.needs.pairwise and (problem := preference_pair_problem(group)):
            return problem
        return self.staleness.check(group, step)

    def _train(self, step: int, groups: list[ExperienceGroup]) -> dict:
        """The step's optimizer step; its metrics plus `padding_fraction` (padded token slots / all slots over the
        step's micro-batches, all data-parallel ranks) and `train_tokens_per_s` (real input tokens of the step /
        seconds from batching to the optimizer step's end, reference log-probs included)."""
        t = self.config
        started = time.perf_counter()
        advantages = group_advantages(self.algorithm, groups)
        per_token = self.algorithm.token_advantages(groups) if self.needs.token_advantages else None
        if not all(np.all(np.isfinite(a)) for a in [*advantages, *(t for g in per_token or [] for t in g)]):
            return {"step_skipped": 1.0, "nonfinite_advantages": 1.0}  # the same on every rank: no optimizer step
        max_len = self.model.max_prompt_len + self.model.max_response_len
        rows = rows_from_groups(groups, advantages, pairs=self.needs.pairwise, max_len=max_len,
                                routing=self.run_config.routing_replay, token_advantages=per_token, images=self.images)
        if self.needs.demonstrations is not None:
            demos = rows_from_groups(self._demos, [np.zeros(len(g.samples)) for g in self._demos], max_len=max_len,
                                     images=self.images)
            for row in demos:
                row.demo = True
            rows += demos
        plan = plan_micro_batches(rows, dp_size=self.policy.layout.dp, micro_batch_size=t.micro_batch_size,
                                  max_tokens_per_micro_batch=t.max_tokens_per_micro_batch, trained_version=step - 1)
        micro_batches = plan.for_rank(self.policy.layout.dp_rank,
                                      collate_images=self.policy.collate_images if self.images else None)
        if self.needs.reference:
            for mb, ref in zip(micro_batches, self.policy.reference_logprobs(micro_batches), strict=True):
                mb["ref_logprobs"] = ref
        if self.needs.teacher is not None:
            for mb, teacher in zip(micro_batches, self.policy.teacher_logprobs(micro_batches), strict=True):
                mb["teacher_logprobs"] = teacher
        if self.needs.step:
            for mb in micro_batches:
                mb["step"] = torch.tensor(float(step))
        if self.needs.step_start is not None:
            micro_batches = self._step_start(self.needs.step_start, micro_batches)
        need = self.needs.critic
        if self.critic is not None and need is not None:
            micro_batches = need.add_targets(micro_batches, self.critic.values(micro_batches),
                                             self.critic.sum_over_data_parallel)
        metrics = self.policy.train_step(micro_batches, self.loss_fn)
        if self.critic is not None and need is not None:
            critic = self.critic.train_step(micro_batches, need.value_loss_fn)
            metrics.update({k if k.startswith("value_") or k == "return_mean" else f"critic_{k}": v
                            for k, v in critic.items()})
        seconds = max(time.perf_counter() - started, 1e-9)
        replayed = {"routing_replayed": replayed_fraction(rows)} if self.run_config.routing_replay else {}
        return {**metrics, "padding_fraction": plan.padding_fraction, "train_s": seconds,
                "train_tokens_per_s": plan.real_tokens / seconds, **replayed}

    def _step_start(self, need: StepStart, micro_batches: list[dict]) -> list[dict]:
        """`needs.step_start`: the policy's per-token quantities at the step's starting weights on every micro-batch,
        then the algorithm's `prepare` over this rank's micro-batches (collective over the data-parallel ranks)."""
        start = self.policy.step_start(micro_batches, entropy=need.entropy, collision=need.collision)
        for mb, values in zip(micro_batches, start, strict=True):
            mb.update(values)
        return need.prepare(micro_batches, self.policy.sum_over_data_parallel)

    def _export_final(self) -> None:
        """The final weights as a Hugging Face directory (`<run dir>/final`), for evaluation and serving. Rank 0
        decides for every rank: on a shared filesystem another rank could see the directory rank 0 has begun to
        write, skip the collective gather, and leave rank 0 waiting."""
        final = self.run_dir / "final"
        # rank 0 decides for all ranks (on a shared filesystem another rank may see rank 0's directory appear);
        # written aside and renamed: a later stage may start from it
        if self.step and not dist_io.broadcast_flag(final.exists()):
            partial = self.run_dir / "final.partial"
            if self.is_reader:
                shutil.rmtree(partial, ignore_errors=True)
            if self.policy.save_hf(partial) is not None:
                durable_replace(partial, final)

    def _checkpoint(self, step: int) -> None:
        """Commit the checkpoint of `step` (every rank), once version `step` is out (WeightSync.flush). The critic's
        is in the same step directory: committed, and resumed, together with the policy's."""
        self._last_checkpoint = step
        path = self.checkpoints.step_dir(step)
        path.mkdir(parents=True, exist_ok=True)
        self.policy.save_checkpoint(path / "model")
        if self.critic is not None:
            self.critic.save_checkpoint(path / "critic")
        sync_tree(path)  # this rank's files (and the others': cheap when clean) durable before `latest` names them
        dist_io.barrier()
        self.weights.flush()  # a checkpoint at step s commits only once version s is out (resume never waits on it)
        if self.is_reader:
            self.reader.flush_dead_letters()  # the records this checkpoint consumes: their dead letters are out
            self.checkpoints.write_state(path, TrainerState(
                step=step, feed=self.feed.snapshot(), counters=self.counters, rng=capture_rng(),
                replay_buffer=self.replay.buffer.to_json() if self.replay else {},
                demonstrations=(self.reader.demonstrations.snapshot().to_json()
                                if self.reader.demonstrations is not None else {}), lineage=self.lineage))
            self.checkpoints.commit(step)
            if self.reader.collector is not None:
                self.reader.collector.after_checkpoint()  # in the background: the parts no reader needs any more
        dist_io.barrier()

    def _log(self, step: int, groups: list[ExperienceGroup], skipped: dict[str, int], metrics: dict,
             started: float) -> None:
        skipped, drops = split_drops(skipped, self.feed.operators)  # the operators' drops: dropped/<reason>
        with open(self.consumed_path, "a") as f:
            for g, reuse in zip(groups, self._reuse, strict=True):
                f.write(json.dumps({"step": step, "group_id": g.group_id, "policy_version": g.policy_version,
                                    "staleness": staleness(step, g.policy_version), "reuse": reuse}) + "\n")
        samples = sum(len(g.samples) for g in groups)
        tokens = sum(len(s.prompt_tokens) + len(s.response_tokens) for g in groups for s in g.samples)
        elapsed = max(time.time() - started, 1e-9)
        self.counters["samples"] += samples
        fresh = [g for g, reuse in zip(groups, self._reuse, strict=True) if reuse == 0] or groups
        rewards = np.concatenate([g.rewards for g in fresh])  # of the policy's own recent rollouts
        record = {
            "step": step, "policy_version": step, "samples": samples,
            "reward_mean": float(rewards.mean()),
            "response_len_mean": float(np.mean([len(s.response_tokens) for g in groups for s in g.samples])),
            "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
            "data_wait_s": self._data_wait_s,  # of step_time_s: waiting for experiences (trainer idle)
            **self.weights.metrics(),
            "skipped": skipped, **drops, **self._failure_metrics(skipped.get("too_few_scored", 0)),
            **{k: _scalar(v) for k, v in metrics.items()},
            **self.staleness.step_metrics(step),
            "staleness_pool_held": self.feed.held,  # groups read and held for a later step (trainer.staleness_policy)
            **(self.replay.step_metrics(step, self._replayed) if self.replay else {}),
            **({"demonstrations": len(self._demos)} if self.needs.demonstrations is not None else {}),
            **self.algorithm.step_metrics(step),
            KEEP_METRIC: self._keep_fraction(sum(r == 0 for r in self._reuse), sum(drops.values())),
        }
        record["consumer_lag"] = self._consumer_lag()
        self.reader.metrics.log(record, step=step)
        self.reader.announce(TrainerStep(step=step, metrics=TrainerStep.step_metrics(record)))  # for `rft status`
        if self.reader.prometheus is not None:
            self.counters["dropped_stale"] = self.counters.get("dropped_stale", 0) + record.get("dropped_stale", 0)
            self.reader.prometheus.update({
                "rft_trainer_step": step, "rft_trainer_weights_version": step,
                "rft_trainer_samples_total": self.counters["samples"],
                "rft_trainer_dropped_stale_samples_total": self.counters["dropped_stale"],
                "rft_trainer_tokens_per_second": record["tokens_per_s"],
                "rft_trainer_reward_mean": record["reward_mean"],
                "rft_trainer_staleness_max": record["staleness_max"],
                "rft_trainer_staleness_mean": record["staleness_mean"],
                "rft_trainer_data_wait_seconds": record["data_wait_s"], "rft_trainer_step_seconds": elapsed,
                "rft_trainer_consumer_lag_records": -1 if record["consumer_lag"] is None else record["consumer_lag"],
            })
        if self.progress:
            print(f"[trainer] step {step}/{self.run_config.max_steps} reward {record['reward_mean']:.3f} "
                  f"loss {record.get('loss', float('nan')):.4f} staleness max {record.get('staleness_max', 0)} "
                  f"{elapsed:.1f}s", flush=True)

    def _failure_metrics(self, dropped: int) -> dict[str, float]:
        """Failed rollouts (the feed's `Batch.failed`) as `failed_<class>` (this step's records) and
        `failed_<class>_total` (the run's, checkpointed with the counters), every class of FAILURE_CLASSES; the
        groups dropped for too few scored samples as `failed_groups_dropped` and `failed_groups_dropped_total`."""
        out: dict[str, float] = {}
        for name, n in [*((c, self._failed.get(c, 0)) for c in FAILURE_CLASSES), ("groups_dropped", dropped)]:
            total = self.counters.get(f"failed_{name}", 0) + n
            self.counters[f"failed_{name}"] = total
            out[f"failed_{name}"], out[f"failed_{name}_total"] = n, total
        return out

    def _keep_fraction(self, kept: int, dropped: int) -> float:
        """The share of fresh groups kept over the last KEEP_WINDOW steps (this one's `kept`, and the groups its
        operators `dropped`): explorers' admission counts on it (rft/explorer/admission.py, "Groups the trainer
        drops"). Stale drops are not in it: they are what over-admission costs, not what the operators take."""
        self._kept.append((kept, dropped))
        total_kept, total = sum(k for k, _ in self._kept), sum(k + d for k, d in self._kept)
        return total_kept / total if total else 1.0

    def _consumer_lag(self) -> int | None:
        """Experience records on the topic not consumed yet (None when the broker does not answer)."""
        try:
            return lag(self.feed.source.end_offsets(self.reader.experiences_topic), self.feed.state.offsets)
        except TransportError:
            return None

    def close(self) -> None:
        self.weights.close()  # before rank 0's control sink closes: the publisher announces on it
        if self.io is not None:
            self.io.close()
        self.policy.close()



def count_skipped_step(counters: dict, metrics: dict) -> None:
    """A step without an optimizer update (`step_skipped`: a NaN / inf loss, gradient or advantage, or an fp16
    overflow) is counted in `counters["steps_skipped"]` (checkpointed with them), logged as `steps_skipped_total`."""
    if metrics.get("step_skipped"):
        counters["steps_skipped"] = counters.get("steps_skipped", 0) + 1
    metrics["steps_skipped_total"] = counters.get("steps_skipped", 0)


def check_parallel_layout(t: TrainerConfig, world_size: int) -> None:
    """ConfigError unless world_size = tensor_parallel x pipeline_parallel x data_parallel (the launchers start that
    many processes; a hand-written srun or torchrun line may not)."""
    model_parallel = t.tensor_parallel * t.pipeline_parallel
    if world_size % model_parallel:
        raise ConfigError(f"trainer.tensor_parallel x trainer.pipeline_parallel = {t.tensor_parallel} x "
                          f"{t.pipeline_parallel} does not divide the world size {world_size} (trainer processes)")
    expected = world_size // model_parallel
    if t.data_parallel != expected:
        raise ConfigError(f"trainer.data_parallel is {t.data_parallel}, but world size {world_size} (trainer "
                          f"processes) / (tensor_parallel {t.tensor_parallel} x pipeline_parallel "
                          f"{t.pipeline_parallel}) = {expected}: set trainer.data_parallel={expected} or start "
                          f"{model_parallel * t.data_parallel} processes")


def _scalar(value):
    return value.item() if hasattr(value, "item") else value


def _truncate_consumed(path: Path, step: int) -> None:
    """Keep only the lines of steps up to `step` (those after it are redone after a resume)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    write_durably(path, "".join(line + "\n" for line in kept))
