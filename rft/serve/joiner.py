"""The joiner (`rft joiner CONFIG`): served completions + their feedback -> experience groups, exactly once.

Inputs: `<prefix>.served` (`ServedCompletion`s) and `<prefix>.feedback` (`Feedback` per rewarded choice), keyed by
request id. Output: `ExperienceGroup`s on `<prefix>.experiences`. Rules (`Joining`, pure and clock-free):
- a request with `n > 1` choices is one group once every choice has its reward (`<run>/serve/<request id>`); at
  expiry the rewarded choices are a group and the rest count as expired;
- single completions wait, by `prompt_key`, for `serve.group_size` rewarded ones of the same prompt (a group); one
  that waited `serve.group_wait_s` joins the baseline window with reward `r - b` (`b` the running mean of the last
  `serve.baseline_window` rewards of its prompt, else of every prompt, else `r`), a group once it holds
  `serve.group_size` samples or its oldest waited `serve.group_wait_s`; raw reward and baseline are kept as reward
  components `feedback` / `baseline`;
- a completion without feedback after `serve.feedback_expire_s` expires (counted, never trained on); feedback for
  an expired, rewarded or unknown choice is counted and dropped; feedback read before its served record waits.
- a group over `kafka.max_record_bytes` even after the claim-check of its large parts is refused, counted
  (`groups_too_large`) and its completions done: committed past, never retried. Records that do not decode (a NaN or
  far-future time, components or ids over the schema's bounds: rft.schema) are dead-lettered.

Exactly-once (`Joiner`): one joiner per run, consumer group `<prefix>.joiner`. A cycle polls, joins, produces the
ready groups, waits for the acks, then commits per partition the offset of the oldest record still held (else the
position): the committed offsets are its checkpoint, so a SIGKILLed joiner loses nothing held. Before starting it
reads the experiences topic from the oldest committed record's time (minus `RESCAN_MARGIN_S`) and treats every
completion named there as done, so none is emitted twice.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from rft.cli.commandline import install_stop_signals
from rft.observability.prometheus import metrics_endpoint
from rft.run.records import run_transport
from rft.schema import (
    ExperienceGroup,
    Feedback,
    RecordError,
    Sample,
    ServedChoice,
    ServedCompletion,
    decode,
    decode_group,
)
from rft.serve.part import part_config
from rft.transport import DeadLetter, RecordTooLarge, connect, resolve_claims
from rft.transport.run_topics import RunTopics

if TYPE_CHECKING:
    from rft.observability.prometheus import MetricsEndpoint
    from rft.serve.config import ServeConfig
    from rft.transport import Transport
    from rft.transport.config import KafkaConfig

log = logging.getLogger("rft.joiner")

RESCAN_MARGIN_S = 300.0  # clock skew tolerated between the hosts that stamp served records and groups
POLL_S = 0.5
SOURCE = "serve"  # group metadata `source` of the joiner's groups


def completion_id(request_id: str, index: int) -> str:
    """The id of one served choice: `<request id>/<index>`."""
    return f"{request_id}/{index}"


def joiner_group(topics: RunTopics) -> str:
    """The joiner's consumer group on the served and feedback topics (its committed offsets are its checkpoint)."""
    return f"{topics.explorers_group.rsplit('.', 1)[0]}.joiner"


Position = tuple[str, int]  # ("topic:partition", offset) of a record the joiner still holds


@dataclass
class _Rewarded:
    """One rewarded choice waiting in a pool."""
    served: ServedCompletion
    choice: ServedChoice
    feedback: Feedback
    positions: list[Position]
    baseline: float | None = None  # set when it moves to the baseline window
    since: float = 0.0  # when it entered its current pool (feedback time, then window time)


@dataclass
class _Pending:
    """A served request whose choices are not all rewarded yet."""
    served: ServedCompletion
    position: Position
    rewards: dict[int, tuple[Feedback, Position]] = field(default_factory=dict)


class Joining:
    """The join itself: records in (`add_served`, `add_feedback`), groups out (`tick(now)`), and the offsets still
    held (`held`). No Kafka and no clock; see the module docstring for the rules."""

    def __init__(self, settings: ServeConfig, run_id: str, *, done: Iterable[str] = ()):
        self.settings, self.run_id = settings, run_id
        self.pending: dict[str, _Pending] = {}
        self.orphans: dict[str, list[tuple[Feedback, Position]]] = {}  # feedback before its served record
        self.singles: dict[str, list[_Rewarded]] = {}  # prompt key -> rewarded singles waiting for peers
        self.window: list[_Rewarded] = []
        # completion ids emitted or expired -> the time their request was served (None: learnt at start); forgotten
        # 2 x feedback_expire_s after that (records that old are expired on sight, never emitted)
        self.done: dict[str, float | None] = dict.fromkeys(done)
        self.history: dict[str, collections.deque] = {}
        self.all_rewards: collections.deque = collections.deque(maxlen=settings.baseline_window)
        self.counts: collections.Counter = collections.Counter()
        self._forgot_at = 0.0

    # -- input
    def add_served(self, served: ServedCompletion, position: Position) -> None:
        if served.request_id in self.pending or all(completion_id(served.request_id, c.index) in self.done
                                                    for c in served.choices):
            self.counts["served_again"] += 1  # re-read after a restart, or a duplicate send
            return
        self.counts["served"] += 1
        self.pending[served.request_id] = _Pending(served, position)
        for feedback, fb_position in self.orphans.pop(served.request_id, []):
            self.add_feedback(feedback, fb_position)

    def add_feedback(self, feedback: Feedback, position: Position) -> None:
        rid = feedback.request_id
        if completion_id(rid, feedback.index) in self.done:
            self.counts["feedback_for_done"] += 1
            return
        pending = self.pending.get(rid)
        if pending is None:
            self.orphans.setdefault(rid, []).append((feedback, position))
            return
        if feedback.index >= len(pending.served.choices):
            self.counts["feedback_bad_index"] += 1
            return
        if feedback.index in pending.rewards:
            self.counts["feedback_duplicate"] += 1
            return
        if feedback.created_at - pending.served.created_at > self.settings.feedback_expire_s:
            self.counts["feedback_late"] += 1
            return
        self.counts["feedback"] += 1
        pending.rewards[feedback.index] = (feedback, position)
        if len(pending.served.choices) == 1:
            del self.pending[rid]
            item = _Rewarded(pending.served, pending.served.choices[0], feedback, [pending.position, position],
                             since=feedback.created_at)
            self._remember(pending.served.prompt_key, item)
            self.singles.setdefault(pending.served.prompt_key, []).append(item)

    def _remember(self, prompt_key: str, item: _Rewarded) -> None:
        """The item's baseline from the rewards before it, then its reward into the history."""
        history = self.history.setdefault(prompt_key, collections.deque(maxlen=self.settings.baseline_window))
        source = history or self.all_rewards
        item.baseline = float(np.mean(source)) if source else float(item.feedback.reward)
        history.append(item.feedback.reward)
        self.all_rewards.append(item.feedback.reward)

    # -- output
    def tick(self, now: float) -> list[ExperienceGroup]:
        """The groups ready at `now` (epoch seconds); expires what waited too long."""
        s = self.settings
        groups = []
        self._forget(now)
        for rid in list(self.pending):
            p = self.pending[rid]
            n = len(p.served.choices)
            if n > 1 and len(p.rewards) == n:
                groups.append(self._request_group(p))
                del self.pending[rid]
            elif now - p.served.created_at > s.feedback_expire_s:
                if p.rewards:
                    groups.append(self._request_group(p))
                for c in p.served.choices:
                    if c.index not in p.rewards:
                        self.done[completion_id(rid, c.index)] = p.served.created_at
                        self.counts["expired"] += 1
                del self.pending[rid]
        for rid in [r for r, items in self.orphans.items() if all(now - f.created_at > s.feedback_expire_s
                                                                  for f, _ in items)]:
            self.counts["feedback_unknown"] += len(self.orphans.pop(rid))
        for key in list(self.singles):
            items = self.singles[key]
            while len(items) >= s.group_size:
                groups.append(self._group(items[:s.group_size], kind="prompt"))
                del items[:s.group_size]
            waited = [i for i in items if now - i.since >= s.group_wait_s]
            for item in waited:
                items.remove(item)
                item.since = now
                self.window.append(item)
            if not items:
                del self.singles[key]
        while len(self.window) >= s.group_size:
            groups.append(self._group(self.window[:s.group_size], kind="window"))
            del self.window[:s.group_size]
        if self.window and now - self.window[0].since >= s.group_wait_s:
            groups.append(self._group(self.window, kind="window"))
            self.window = []
        return groups

    def _forget(self, now: float) -> None:
        """Drop done ids older than 2 x feedback_expire_s (seeded ones count from the first tick)."""
        if now - self._forgot_at < 60:
            return
        self._forgot_at = now
        horizon = 2 * self.settings.feedback_expire_s
        for cid, served_at in list(self.done.items()):
            if served_at is None:
                self.done[cid] = now
            elif now - served_at > horizon:
                del self.done[cid]

    def held(self) -> dict[str, int]:
        """The oldest offset still held per partition ("topic:partition"): where a restart must read again."""
        out: dict[str, int] = {}

        def hold(position: Position) -> None:
            key, offset = position
            out[key] = min(out.get(key, offset), offset)

        for p in self.pending.values():
            hold(p.position)
            for _, position in p.rewards.values():
                hold(position)
        for items in self.orphans.values():
            for _, position in items:
                hold(position)
        for item in [i for items in self.singles.values() for i in items] + self.window:
            for position in item.positions:
                hold(position)
        return out

    def commit_offsets(self, positions: dict[str, int]) -> dict[str, int]:
        """What to commit given the consumer's `positions`: each partition's oldest held offset, else its position."""
        held = self.held()
        return {key: min(position, held.get(key, position)) for key, position in positions.items()}

    def _request_group(self, p: _Pending) -> ExperienceGroup:
        items = [_Rewarded(p.served, c, p.rewards[c.index][0], [p.position, p.rewards[c.index][1]])
                 for c in p.served.choices if c.index in p.rewards]
        return self._group(items, kind="request", group_id=f"{self.run_id}/serve/{p.served.request_id}")

    def _group(self, items: list[_Rewarded], *, kind: str, group_id: str | None = None) -> ExperienceGroup:
        ids = [completion_id(i.served.request_id, i.choice.index) for i in items]
        self.done.update((completion_id(i.served.request_id, i.choice.index), i.served.created_at) for i in items)
        self.counts["groups"] += 1
        self.counts["completions_joined"] += len(items)
        if group_id is None:
            group_id = f"{self.run_id}/serve/{kind}-" + hashlib.sha1("\n".join(ids).encode()).hexdigest()[:16]
        samples = []
        for k, item in enumerate(items):
            reward = item.feedback.reward
            components = dict(item.feedback.components, feedback=reward)
            if kind == "window":
                if item.baseline is None:
                    raise RuntimeError(f"{completion_id(item.served.request_id, item.choice.index)}: in the baseline "
                                       "window without a baseline")
                components["baseline"] = item.baseline
                reward = reward - item.baseline
            samples.append(Sample(
                sample_index=k, prompt_tokens=item.served.prompt_tokens, response_tokens=item.choice.response_tokens,
                logprobs=item.choice.logprobs, loss_mask=np.ones(len(item.choice.response_tokens), dtype=np.uint8),
                reward=float(reward), reward_components=components, finish_reason=item.choice.finish_reason,
                metadata={"request_id": item.served.request_id, "index": item.choice.index,
                          "policy_version": item.served.policy_version}))
        prompt_keys = sorted({i.served.prompt_key for i in items})
        return ExperienceGroup(run_id=self.run_id, task_id=prompt_keys[0] if len(prompt_keys) == 1 else "window",
                               group_id=group_id, attempt=0, explorer_id="joiner",
                               policy_version=min(i.served.policy_version for i in items), samples=samples,
                               metadata={"source": SOURCE, "kind": kind, "completions": ids})


def emitted_completions(group: ExperienceGroup) -> list[str]:
    """The completion ids a joiner's group holds (empty for any other group)."""
    if group.metadata.get("source") != SOURCE:
        return []
    return [str(c) for c in group.metadata.get("completions", [])]


# --------------------------------------------------------------------------------------------------
# The process


class Joiner:
    """The joiner's Kafka loop over `Joining` (module docstring: ordering and exactly-once). `step()` is one cycle;
    `run(stop)` cycles until `stop` is set. `clock` gives epoch seconds (tests pass their own)."""

    def __init__(self, settings: ServeConfig, *, topics: RunTopics, kafka: KafkaConfig,
                 transport: Transport | None = None, client_id: str = "joiner", clock=time.time):
        self.topics, self.kafka, self.clock = topics, kafka, clock
        transport = self.transport = transport or connect(kafka)
        admin = transport.admin()
        try:
            admin.create_topics([topics.served, topics.feedback, topics.dead_letter])
            admin.create_topics([topics.experiences], partitions=kafka.experience_partitions)
        finally:
            admin.close()
        self.group = joiner_group(topics)
        self.source = transport.source(group=self.group, topics=[topics.served, topics.feedback],
                                       client_id=client_id, from_beginning=True)
        self.sink = transport.sink(client_id=client_id)
        self.dead_letter = DeadLetter(self.sink, topics.dead_letter, claims=transport.claims)
        done = self._already_emitted()
        self.joining = Joining(settings, topics.run, done=done)
        log.info("joiner %s: %d completions were emitted before this start", client_id, len(done))

    def _already_emitted(self) -> set[str]:
        """Completion ids on the experiences topic since the oldest committed input record (module docstring)."""
        reader = self.transport.source(client_id=f"{self.group}-rescan")
        try:
            times: list[int | None] = []  # the time of the first record to be read again, per partition that has one
            for topic in (self.topics.served, self.topics.feedback):
                ends, starts = reader.end_offsets(topic), reader.beginning_offsets(topic)
                for key, offset in self.source.committed(topic).items():
                    offset = starts.get(key, 0) if offset is None else offset  # never committed: from the start
                    if offset < ends.get(key, 0):
                        m = reader.fetch(key, offset)
                        times.append(None if m is None else m.timestamp_ms)  # None: gone, scan everything
            if not times:
                return set()  # nothing will be read again
            known = [t for t in times if t is not None]
            since = int(min(known) - RESCAN_MARGIN_S * 1000) if len(known) == len(times) else None
            done: set[str] = set()
            for m in reader.read_range(self.topics.experiences, from_time_ms=since, idle_timeout_s=5.0):
                try:
                    inline = resolve_claims(m, self.transport.claims)
                    done.update(emitted_completions(decode_group(inline.value, inline.headers)))
                except RecordError:
                    continue
            return done
        finally:
            reader.close()

    def step(self) -> list[ExperienceGroup]:
        """One cycle: poll, join, produce the ready groups, wait for the acks, commit; returns the groups sent."""
        messages = self.source.poll(timeout_s=POLL_S, max_records=1000)
        for m, record in self.dead_letter.decode(messages, decode):
            position = (m.position, m.offset)
            if getattr(record, "run_id", None) != self.topics.run:
                self.dead_letter.divert(m, f"foreign or unexpected record on {m.topic}: {type(record).__name__}")
            elif isinstance(record, ServedCompletion) and m.topic == self.topics.served:
                self.joining.add_served(record, position)
            elif isinstance(record, Feedback) and m.topic == self.topics.feedback:
                self.joining.add_feedback(record, position)
            else:
                self.dead_letter.divert(m, f"a {type(record).__name__} does not belong on {m.topic}")
        groups = self.joining.tick(self.clock())
        futures = []
        for g in list(groups):
            try:
                futures.append(self.sink.send_record(self.topics.experiences, g, key=g.group_id))
            except RecordTooLarge as e:  # the same at every restart: refused and counted, its records committed past
                groups.remove(g)
                self.joining.counts["groups_too_large"] += 1
                log.warning("group %s of %d completions refused: %s", g.group_id, len(g.samples), e)
        self.sink.flush()
        for future in futures:
            future.get(timeout=self.kafka.request_timeout_ms / 1000)  # raises: nothing is committed
        positions = self.source.positions()
        if positions:
            self.source.commit(self.joining.commit_offsets(positions))
        return groups

    def run(self, stop: threading.Event, *, prometheus: MetricsEndpoint | None = None) -> None:
        """Cycle until `stop`; `prometheus` gets the counts as `rft_joiner_<count>_total` after each cycle."""
        while not stop.is_set():
            groups = self.step()
            if groups:
                log.info("sent %d groups (%s)", len(groups), dict(self.joining.counts))
            if prometheus is not None:
                prometheus.update({f"rft_joiner_{k}_total": v for k, v in self.joining.counts.items()})

    def close(self) -> None:
        log.info("joiner stats: %s", dict(self.joining.counts))
        self.source.close()
        self.sink.close()


def main(argv: list[str]) -> int:
    cfg, _ = part_config("rft joiner", "Join served completions and their feedback into experience groups "
                         "(serve mode).", argv)
    stop = threading.Event()
    install_stop_signals(stop)
    joiner = Joiner(cfg.serve, topics=RunTopics.of(cfg), kafka=cfg.kafka, transport=run_transport(cfg))
    prometheus = metrics_endpoint(cfg.monitor, run=cfg.run.name, role="joiner", instance="joiner")
    try:
        joiner.run(stop, prometheus=prometheus)
    finally:
        joiner.close()
        if prometheus is not None:
            prometheus.close()
    return 0
