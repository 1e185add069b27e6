"""The control protocol: one typed message per control kind, and `ControlView`, the one fold of them.

Wire format (docs/schema.md, schema 1): a `schema.ControlMessage(kind, sender, body, created_at)` whose body keys are
exactly the fields of the kind's dataclass below. Senders send `to_message()`; readers `parse()` a ControlMessage
(None for an unknown kind: ignored). `from_message()` raises ControlError naming the kind and field for a missing
required field or a wrong type; missing optional fields take defaults; unknown extra keys are ignored.

Kinds, sender `trainer`: `weights` (a pull-path version in the store at `path`, with consumed `offsets`),
`weights_push` (a version being pushed in group `group_id`), `push_group` (a group to join: PushGroupSpec),
`push_abandoned` (push given up at `version`: everyone pulls from then on), `trainer_started` (step, version,
offsets), `trainer_waiting` (waits for data; offsets, read by admission), `trainer_finished`, `trainer_step` (a few
of the step's metrics, TRAINER_STEP_METRICS, for `rft status`).
Sender an explorer id: `explorer_join`, `explorer_heartbeat` (every explorer.heartbeat_s, with counters),
`explorer_weights` (loaded `version`; `seconds` None when pushed), `explorer_leave` (and why), `tasks_group` (the
explorers moved to consumer group `group`, epoch `epoch`, seeded with `offsets`: rft/explorer/membership.py),
`admission_claim` and `admission_release` (partition 0; the admission ledger, rft/explorer/admission.py).

`ControlView.apply()` folds messages; the trainer's state follows its newest message (partitions interleave; an older
one read later is ignored), so the view never goes back in time. A malformed message is counted, never raised.

Bounds (the control topic is not trusted, docs/security.md): every integer field within `FIELD_BOUNDS` by name
(versions and steps 0..MAX_VERSION: a store names a version by 8 digits, rft.weights.store.version_dirname; epochs
1..MAX_EPOCH; ports 0..65535; offsets >= 0), any other integer within +-MAX_INT, floats finite, strings up to
MAX_TEXT characters, maps and lists up to MAX_ITEMS entries: anything else is a ControlError. The view also refuses
(counts in `malformed`, ignores) a message stamped more than MAX_FUTURE_S ahead of this host's clock (it would hold
the trainer's state for good) and a `tasks_group` move that is not the next epoch of the one in force (moves go one
epoch at a time, rft/explorer/membership.py: a forged far epoch would move the fleet for good).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from rft.schema import FAILURE_CLASSES, MAX_CLOCK_SKEW_S, ControlMessage, RecordError, decode

log = logging.getLogger(__name__)

TRAINER = "trainer"


class ControlError(ValueError):
    """A control message of a known kind whose body does not fit the kind."""


MAX_VERSION = 10**8 - 1  # the highest weights version (and trainer step): store directories hold 8 digits
MAX_EPOCH = 10_000  # the highest tasks_group epoch (one move per explorer.unassigned_rejoin_s at most)
MAX_INT = 2**53  # any other integer field, in absolute value
MAX_TEXT = 4096  # characters of a string field (ids, paths, hosts, reasons)
MAX_ITEMS = 4096  # entries of a map or list field (offsets, metrics, partitions)
MAX_FUTURE_S = MAX_CLOCK_SKEW_S  # how far ahead of this host's clock a message may be stamped
_VERSION_BOUNDS = (0, MAX_VERSION)
# integer fields bounded by name (a map's values take its name's bounds: offsets)
FIELD_BOUNDS: dict[str, tuple[int, int]] = {
    "version": _VERSION_BOUNDS, "weights_version": _VERSION_BOUNDS, "step": _VERSION_BOUNDS,
    "epoch": (1, MAX_EPOCH), "port": (0, 65535), "prometheus_port": (0, 65535), "offsets": (0, MAX_INT),
    "world_size": (1, 1 << 20), "groups_in_batch": (0, MAX_INT), "partitions": (0, 1 << 20)}


# --------------------------------------------------------------------------------------------------
# Field validation


def _check(kind: str, name: str, value: Any, hint: Any, bounds: tuple[int, int] | None = None) -> Any:
    """`value` as type `hint` (int, float, str, bool, Optional[X], dict[str, int], list[int]) within the module's
    bounds (`bounds`: an integer's, default FIELD_BOUNDS of the field's name), else ControlError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    bounds = bounds or FIELD_BOUNDS.get(name, (-MAX_INT, MAX_INT))
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(kind, name, value, inner, bounds)
    if origin in (dict, list) and isinstance(value, (dict, list, tuple)) and len(value) > MAX_ITEMS:
        raise ControlError(f"{kind}: field {name!r} has {len(value)} entries, over {MAX_ITEMS}")
    if origin is dict:
        if not isinstance(value, dict):
            raise ControlError(f"{kind}: field {name!r} must be a map, got {value!r:.80}")
        if any(len(str(k)) > MAX_TEXT for k in value):
            raise ControlError(f"{kind}: field {name!r} has a key over {MAX_TEXT} characters")
        return {str(k): _check(kind, f"{name}[{k!r}]", v, args[1], bounds) for k, v in value.items()}
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ControlError(f"{kind}: field {name!r} must be a list, got {value!r:.80}")
        return [_check(kind, f"{name}[{i}]", v, args[0], bounds) for i, v in enumerate(value)]
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ControlError(f"{kind}: field {name!r} must be a finite number, got {value!r}")
        return float(value)
    if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        if hint is int and not bounds[0] <= value <= bounds[1]:
            raise ControlError(f"{kind}: field {name!r} is {value}, outside {bounds[0]}..{bounds[1]}")
        if hint is str and len(value) > MAX_TEXT:
            raise ControlError(f"{kind}: field {name!r} has {len(value)} characters, over {MAX_TEXT}")
        return value
    raise ControlError(f"{kind}: field {name!r} must be {hint.__name__}, got {value!r:.80}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class Kind:
    """Base of the control kinds: `KIND` (the wire string), `to_message()`, `from_message()`."""
    KIND: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # every kind is a dataclass

    @property
    def sender(self) -> str:
        return TRAINER

    def body(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_message(self, *, created_at: float | None = None) -> ControlMessage:
        return ControlMessage(kind=self.KIND, sender=self.sender, body=self.body(),
                              created_at=time.time() if created_at is None else created_at)

    @classmethod
    def from_body(cls, body: dict, *, sender: str = ""):
        """Validate `body` (see the module docstring); ControlError if it does not fit."""
        if not isinstance(body, dict):
            raise ControlError(f"{cls.KIND}: body must be a map, got {body!r:.80}")
        hints = _hints(cls)  # type: ignore[arg-type]  # mypy takes a class object for unhashable (type[X] vs Hashable)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in body:
                values[f.name] = _check(cls.KIND, f.name, body[f.name], hints[f.name])
            elif f.name == "explorer_id" and sender and len(sender) > MAX_TEXT:
                raise ControlError(f"{cls.KIND}: sender has {len(sender)} characters, over {MAX_TEXT}")
            elif f.name == "explorer_id" and sender:
                values[f.name] = sender  # explorers' messages: the sender is the explorer id
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ControlError(f"{cls.KIND}: missing field {f.name!r}")
        return cls(**values)

    @classmethod
    def from_message(cls, message: ControlMessage):
        if message.kind != cls.KIND:
            raise ControlError(f"expected a {cls.KIND} message, got {message.kind!r}")
        return cls.from_body(message.body, sender=message.sender)


class _FromExplorer(Kind):
    explorer_id: str

    @property
    def sender(self) -> str:
        return self.explorer_id


# --------------------------------------------------------------------------------------------------
# The kinds


@dataclass(frozen=True)
class Weights(Kind):
    KIND: ClassVar[str] = "weights"
    version: int
    path: str = ""
    offsets: dict[str, int] = field(default_factory=dict)
    lineage: str = ""  # the weight store's lineage id (rft.weights.store); "" from a trainer before lineages


@dataclass(frozen=True)
class WeightsPush(Kind):
    KIND: ClassVar[str] = "weights_push"
    group_id: str
    version: int
    offsets: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PushGroup(Kind):
    """What a member needs to join a push group (rft.weights.push)."""
    KIND: ClassVar[str] = "push_group"
    group_id: str  # one per trainer incarnation: a restarted trainer forms a new group
    host: str
    port: int
    world_size: int
    backend: str  # gloo | nccl (rft.weights.push) | vllm-nccl (rft.weights.vllm_transfer)
    timeout_s: float
    lineage: str = ""  # the weight store's lineage id the pushed versions belong to ("": a trainer before lineages)


@dataclass(frozen=True)
class PushAbandoned(Kind):
    KIND: ClassVar[str] = "push_abandoned"
    group_id: str
    version: int | None = None
    reason: str = ""


@dataclass(frozen=True)
class TrainerStarted(Kind):
    KIND: ClassVar[str] = "trainer_started"
    step: int
    version: int
    offsets: dict[str, int] = field(default_factory=dict)
    prometheus_port: int | None = None


@dataclass(frozen=True)
class TrainerWaiting(Kind):
    KIND: ClassVar[str] = "trainer_waiting"
    version: int
    offsets: dict[str, int] = field(default_factory=dict)
    groups_in_batch: int = 0


KEEP_METRIC = "keep_fraction"  # the share of its recent fresh groups the trainer kept (explorer admission reads it)
# failed rollouts the trainer met, run totals (rft/trainer/feed.py: per failure class, and groups left too few scored)
FAILURE_TOTALS = (*(f"failed_{c}_total" for c in FAILURE_CLASSES), "failed_groups_dropped_total")
TRAINER_STEP_METRICS = ("loss", "reward_mean", "kl", "staleness_mean", "staleness_max", "dropped_stale", KEEP_METRIC,
                        "data_wait_s", "step_time_s", "entropy", *FAILURE_TOTALS)
TRAINER_STEP_PREFIXES = ("logprob_mismatch_",)  # and every metric named so (rft/algorithms/mismatch.py)


@dataclass(frozen=True)
class TrainerStep(Kind):
    """After each step: its number and the metrics of `step_metrics` (a few numbers, for `rft status`)."""
    KIND: ClassVar[str] = "trainer_step"
    step: int
    metrics: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def step_metrics(record: dict) -> dict[str, float]:
        """The numbers of a step's metrics record that the message carries: TRAINER_STEP_METRICS and the names
        starting with TRAINER_STEP_PREFIXES."""
        return {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                and (k in TRAINER_STEP_METRICS or k.startswith(TRAINER_STEP_PREFIXES))}


@dataclass(frozen=True)
class TrainerFinished(Kind):
    KIND: ClassVar[str] = "trainer_finished"
    step: int | None = None


@dataclass(frozen=True)
class ExplorerJoin(_FromExplorer):
    KIND: ClassVar[str] = "explorer_join"
    explorer_id: str
    weights_version: int | None = None
    host: str = ""
    pid: int | None = None
    prometheus_port: int | None = None


@dataclass(frozen=True)
class ExplorerHeartbeat(_FromExplorer):
    """Counters since joining; `explore_s` of `joined_s` was spent generating and scoring; `partitions`: the
    tasks partitions held at the last poll; `unassigned_s`: how long it has held none (0 while it holds some);
    `rejoins`: how often its membership watchdog rejoined the group (rft/explorer/membership.py); `failed`: its
    samples marked failed, per failure class (rft.schema.FAILURE_CLASSES)."""
    KIND: ClassVar[str] = "explorer_heartbeat"
    explorer_id: str
    weights_version: int | None = None
    groups: int | None = None
    batches: int | None = None
    dead_letters: int | None = None
    admission_waits: int | None = None
    weights_refused: int | None = None  # weights versions / push groups refused (rft.weights.subscriber: trust)
    explore_s: float = 0.0
    joined_s: float = 0.0
    partitions: list[int] = field(default_factory=list)
    unassigned_s: float = 0.0
    rejoins: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # failed samples per failure class (Sample.failure)


@dataclass(frozen=True)
class ExplorerWeights(_FromExplorer):
    KIND: ClassVar[str] = "explorer_weights"
    explorer_id: str
    version: int
    seconds: float | None = None  # None: received by push


@dataclass(frozen=True)
class ExplorerLeave(_FromExplorer):
    KIND: ClassVar[str] = "explorer_leave"
    explorer_id: str
    reason: str = ""
    groups: int | None = None


@dataclass(frozen=True)
class TasksGroup(_FromExplorer):
    """The explorers' consumer group on the tasks topic is now `group` (epoch `epoch`; epoch 0 is `<run>.explorers`),
    seeded with `offsets` ("topic:partition" -> next offset), because the previous one gave nobody a partition."""
    KIND: ClassVar[str] = "tasks_group"
    explorer_id: str
    group: str
    epoch: int
    offsets: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class AdmissionClaim(_FromExplorer):
    """An explorer asks to start `groups` groups. `limit` is the fleet's capacity (k + version + 1) * B -
    accepted_fleet as it read the fleet after applying the admission messages of control partition 0 below offset
    `seen`; `claim_id` names the claim (its grant is the ledger's fold of the log, rft/explorer/admission.py)."""
    KIND: ClassVar[str] = "admission_claim"
    explorer_id: str
    claim_id: str
    groups: int
    limit: int
    seen: int
    version: int = 0


@dataclass(frozen=True)
class AdmissionRelease(_FromExplorer):
    """`groups` of `explorer_id`'s granted groups ended (produced or given up); `reset`: all of them, whatever
    `groups` says (sent by the explorer itself when it starts or leaves, or by `by` for a silent one)."""
    KIND: ClassVar[str] = "admission_release"
    explorer_id: str
    groups: int = 0
    reset: bool = False
    by: str = ""

    @property
    def sender(self) -> str:
        return self.by or self.explorer_id


KINDS: dict[str, type[Kind]] = {k.KIND: k for k in (
    Weights, WeightsPush, PushGroup, PushAbandoned, TrainerStarted, TrainerWaiting, TrainerStep, TrainerFinished,
    ExplorerJoin, ExplorerHeartbeat, ExplorerWeights, ExplorerLeave, TasksGroup, AdmissionClaim, AdmissionRelease)}
ADMISSION_PARTITION = 0  # claims and releases go to this control partition: one log, one order (the ledger)
TRAINER_STATES = {Weights: "training", WeightsPush: "training", TrainerStarted: "started",
                  TrainerWaiting: "waiting", TrainerStep: "training", TrainerFinished: "finished"}


def parse(message: ControlMessage) -> Kind | None:
    """The typed message; None for a kind this version does not know; ControlError if malformed."""
    cls = KINDS.get(message.kind)
    return None if cls is None else cls.from_message(message)


def control_messages(records: Iterable, *,
                     undecodable: Callable[[Any, RecordError], None] | None = None) -> Iterator[ControlMessage]:
    """The control messages among transport records (`.value`, `.headers`); other records are skipped: other
    roles write to the control topic too, and a reader is not the judge of them. `undecodable(record, error)`,
    when given, hears of each record that is no schema record at all (a reader that counts them)."""
    for m in records:
        try:
            message = decode(m.value, m.headers)
        except RecordError as e:
            if undecodable is not None:
                undecodable(m, e)
            continue
        if isinstance(message, ControlMessage):
            yield message


# --------------------------------------------------------------------------------------------------
# The fold


@dataclass
class TrainerView:
    """The trainer as its newest message tells it (`rft status` prints these fields)."""
    state: str = "not started"  # started | training | waiting | finished | not started
    step: int = 0
    version: int = 0
    offsets: dict[str, int] = field(default_factory=dict)  # experiences consumed, "topic:partition" -> offset
    groups_in_batch: int = 0  # of the consumed ones, groups taken into the step it waits to complete (trainer_waiting)
    prometheus_port: int | None = None
    last_seen: float = 0.0  # created_at of the trainer message in force
    metrics: dict[str, float] = field(default_factory=dict)  # of its newest step (trainer_step)
    history: list[tuple[float, int]] = field(default_factory=list, repr=False)  # (time, version) of announcements


@dataclass
class ExplorerView:
    """One explorer as its messages tell it (`rft status` prints these fields)."""
    explorer_id: str
    host: str = ""
    pid: int | None = None
    prometheus_port: int | None = None
    state: str = "live"  # live | left (rft status adds silent: no message for 3 heartbeats)
    left_reason: str = ""
    weights_version: int = 0
    groups: int = 0
    batches: int = 0
    dead_letters: int = 0
    admission_waits: int = 0
    weights_refused: int = 0
    busy: float | None = None  # fraction of its time spent generating and scoring
    partitions: list[int] = field(default_factory=list)  # tasks partitions held, as its newest heartbeat says
    unassigned_s: float = 0.0  # how long it had held no partition, as its newest heartbeat says
    rejoins: int = 0  # rejoins by its membership watchdog
    failed: dict[str, int] = field(default_factory=dict)  # failed samples per failure class, as its heartbeat says
    last_seen: float = 0.0  # created_at of its newest message
    history: list[tuple[float, int]] = field(default_factory=list, repr=False)  # (time, groups) of heartbeats


class ControlView:
    """What the control topic has said so far (module docstring: ordering). Not thread-safe.

    - `trainer`: the trainer's state, version, consumed offsets (messages from sender `trainer` only);
    - `explorers`: each explorer's last signs; `heard`: when this process read each one's newest message;
    - weights: `announced` (the newest `weights` version with a path), `weights_path` (the path of the newest
      `weights` message), `push_group` (the newest push group), `pushed` (group id -> versions announced as
      pushed, in the order read) and `abandoned` (push groups given up);
    - `tasks_group`: the newest (highest epoch) move of the explorers' consumer group, None before any.
    """

    def __init__(self) -> None:
        self.trainer = TrainerView()
        self.explorers: dict[str, ExplorerView] = {}
        self.heard: dict[str, float] = {}
        self.announced: Weights | None = None
        self.weights_path = ""
        self.push_group: PushGroup | None = None
        self.pushed: dict[str, list[int]] = {}
        self.abandoned: set[str] = set()
        self.tasks_group: TasksGroup | None = None
        self.malformed = 0

    @property
    def trainer_finished(self) -> bool:
        return self.trainer.state == "finished"

    @property
    def push_abandoned(self) -> bool:
        """The newest push group was given up (the run pulls)."""
        return self.push_group is not None and self.push_group.group_id in self.abandoned

    def live_explorers(self, now: float, horizon_s: float) -> int:
        """Explorers that have not left and were heard from within `horizon_s` of `now` (this process's clock)."""
        return len(self.live_explorer_ids(now, horizon_s))

    def live_explorer_ids(self, now: float, horizon_s: float) -> list[str]:
        """The ids of `live_explorers`, sorted."""
        return sorted(e for e, heard in self.heard.items()
                      if now - heard <= horizon_s and self.explorers[e].state == "live")

    def apply_records(self, records: Iterable) -> None:
        """`apply` each control message among transport records, now."""
        now = time.time()
        for message in control_messages(records):
            self.apply(message, received_at=now)

    def apply(self, message: ControlMessage, *, received_at: float | None = None) -> None:
        try:
            kind = parse(message)
            if kind is not None:
                self._check_time(message)
        except ControlError as e:
            self.refuse(message.sender, e)
            return
        if kind is None or isinstance(kind, (AdmissionClaim, AdmissionRelease)):
            return  # the admission ledger's (rft/explorer/admission.py); liveness is the heartbeats'
        if isinstance(kind, TasksGroup) and (problem := self._move_problem(kind)):
            if problem != "known":
                self.refuse(message.sender, ControlError(f"tasks_group: {problem}"))
            return
        self._apply_weights(kind)
        if isinstance(kind, _FromExplorer):
            self._apply_explorer(kind, message.created_at)
            self.heard[kind.explorer_id] = time.time() if received_at is None else received_at
        elif message.sender == TRAINER and message.created_at >= self.trainer.last_seen:
            self._apply_trainer(kind, message.created_at)

    def refuse(self, sender: str, error: object) -> None:
        """Count (`malformed`) and log a message from `sender` that is ignored."""
        self.malformed += 1
        log.warning("skipping a malformed control message from %.80s: %s (skipped so far: %d)", sender, error,
                    self.malformed)

    @staticmethod
    def _check_time(message: ControlMessage) -> None:
        if not math.isfinite(message.created_at) or message.created_at > time.time() + MAX_FUTURE_S:
            raise ControlError(f"{message.kind}: created_at {message.created_at!r} is not finite or is more than "
                               f"{MAX_FUTURE_S:.0f} s ahead of this host's clock")

    def _move_problem(self, move: TasksGroup) -> str | None:
        """None when `move` is the next epoch of the move in force; "known" for one already in force or passed (two
        explorers moving at once announce the same epoch); else why it is refused."""
        current = 0 if self.tasks_group is None else self.tasks_group.epoch
        if move.epoch <= current:
            return "known"
        if move.epoch != current + 1:
            return (f"epoch {move.epoch} skips ahead of the move in force (epoch {current}): the explorers move one "
                    "epoch at a time")
        return None

    def _apply_weights(self, kind: Kind) -> None:
        if isinstance(kind, Weights):
            self.weights_path = kind.path
            if kind.path and (self.announced is None or kind.version > self.announced.version):
                self.announced = kind
        elif isinstance(kind, PushGroup):
            self.push_group = kind
        elif isinstance(kind, WeightsPush):
            self.pushed.setdefault(kind.group_id, []).append(kind.version)
        elif isinstance(kind, PushAbandoned):
            self.abandoned.add(kind.group_id)
        elif isinstance(kind, TasksGroup):  # the next epoch (apply)
            self.tasks_group = kind

    def _apply_trainer(self, kind: Kind, when: float) -> None:
        t = self.trainer
        t.last_seen = when
        t.state = TRAINER_STATES.get(type(kind), t.state)
        if isinstance(kind, (Weights, WeightsPush, TrainerStarted, TrainerWaiting)):
            t.version, t.offsets = kind.version, dict(kind.offsets)
            t.groups_in_batch = kind.groups_in_batch if isinstance(kind, TrainerWaiting) else 0  # at a step's end
            t.history.append((when, t.version))
        step = getattr(kind, "step", None)
        t.step = step if step is not None else max(t.step, t.version)
        if isinstance(kind, TrainerStarted):
            t.prometheus_port = kind.prometheus_port
        if isinstance(kind, TrainerStep):
            t.metrics = dict(kind.metrics)

    def _apply_explorer(self, kind: _FromExplorer, when: float) -> None:
        e = self.explorers.setdefault(kind.explorer_id, ExplorerView(kind.explorer_id))
        e.last_seen = max(e.last_seen, when)
        if isinstance(kind, ExplorerJoin):
            e.state, e.left_reason, e.history = "live", "", []
            e.host, e.pid, e.prometheus_port = kind.host, kind.pid, kind.prometheus_port
        elif isinstance(kind, ExplorerLeave):
            e.state, e.left_reason = "left", kind.reason
        elif isinstance(kind, ExplorerWeights):
            e.weights_version = kind.version
        if (weights_version := getattr(kind, "weights_version", None)) is not None:
            e.weights_version = weights_version
        for name in ("groups", "batches", "dead_letters", "admission_waits", "weights_refused"):
            if getattr(kind, name, None) is not None:
                setattr(e, name, getattr(kind, name))
        if isinstance(kind, ExplorerHeartbeat):
            e.history.append((when, e.groups))
            e.partitions, e.unassigned_s, e.rejoins = list(kind.partitions), kind.unassigned_s, kind.rejoins
            e.failed = dict(kind.failed)
            if kind.joined_s:
                e.busy = kind.explore_s / kind.joined_s

