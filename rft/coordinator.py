"""The coordinator: how explorers get weights and learn the run's state, and how bounded staleness is enforced
fleet-wide.

Where the weight-broadcast role lives: in the trainer's publishing rank (global rank 0), as `WeightCoordinator`.
After each optimizer step s the trainer streams version s in HF layout (megatron_bridge buckets) to it, and it
delivers the version by the configured path (`sync.method`):

Pull (elastic fleets, the default). Version s is written to the weight store, then announced on the control
topic (kind `weights`, body: version, path, and the trainer's consumed offsets). Ordering contract:
  1. a version directory is complete (written to a temporary name, renamed) before LATEST points to it, and
     LATEST is updated before the announcement is sent;
  2. a published version is never rewritten; the store keeps the newest `sync.keep_versions`, so an explorer
     may find an announced version already gone and then takes the newest one (it retries);
  3. an explorer loads the newest version before it joins the tasks consumer group (late joiners generate
     nothing with old weights), and before every batch;
  4. every experience group carries the version that generated it; the trainer, not the explorer, has the
     last word on staleness (it drops and counts what exceeds the bound).

Push (fixed fleets: `explorer.replicas` engines of `explorer.tensor_parallel_size` workers). The coordinator hosts
a process group (rft.weight_push; gloo on CPU, NCCL on GPU) and announces it (kind `push_group`) every few seconds
until every engine worker has joined, at most `sync.timeout_s`. Then, per version:
  1. it announces `weights_push` {group_id, version, offsets} and broadcasts the buckets;
  2. explorers take part between two batches (never during generation), load the tensors in place and ack;
  3. the broadcast returns after every member acked: only then does the trainer start the next step (the
     buffers may be reused), and each explorer resumes generating with the version it just acked.
  If the group cannot be formed in time, or a push fails or times out (an explorer died: a fixed group cannot
  lose a member), the coordinator announces `push_abandoned` and uses the pull path for the rest of the run,
  starting with the version whose push failed; explorers then pull. A restarted trainer forms a new group
  (new group_id); explorers leave the old one and join it.

Admission control (`FleetAdmission`, selected by `explorer.admission: staleness`, the default) follows AReaL's
staleness manager, fleet-wide: with B = trainer.groups_per_step and k the staleness bound of the mode,

    capacity = (k + v_explorer + 1) * B - (v_trainer * B + backlog)

where v_explorer is the weights version this explorer has loaded, v_trainer the trainer's newest version, and
backlog = experience records produced but not yet consumed by the trainer (the experiences topic's end offsets
minus the trainer's consumed offsets, as last announced). This is AReaL's
(k + version + 1) * B - (accepted + running) with accepted = v_trainer * B + backlog: a group started now at
v_explorer is consumed at step v_trainer + backlog / B + 1 at the latest, so its staleness stays <= k.
The trainer announces its consumed offsets after every step and, while it waits for data, every few seconds
(kind `trainer_waiting`), so records it skipped (stale, duplicate) never block admission. Each of the n live
explorers (seen on the control topic within three heartbeat intervals) may start capacity / n rollouts, so the
fleet as a whole never starts more than the capacity; between two reads of the topic's end (every
`refresh_s`) an explorer also counts what it admitted itself meanwhile. A restarted trainer announces its rewound offsets, the
backlog grows by what it will consume again, and admission tightens by itself.
"""
from __future__ import annotations

import logging
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable

from rft.config import Config
from rft.schema import ControlMessage, RecordError, decode
from rft.staleness import staleness_bound

log = logging.getLogger(__name__)


@dataclass
class FleetView:
    """What the control topic has said so far: the trainer's newest announcement and explorers' last signs."""
    trainer_version: int = 0
    trainer_offsets: dict[str, int] = field(default_factory=dict)
    explorers_seen: dict[str, float] = field(default_factory=dict)  # explorer id -> time of its last message
    finished: bool = False
    trainer_time: float = 0.0  # created_at of the trainer message in force

    def apply(self, message: ControlMessage, now: float) -> None:
        """Messages arrive in partition order, not time order: a trainer message older than the one in force
        is ignored, so the view never goes back in time."""
        body = message.body
        if message.sender == "trainer":
            if message.created_at < self.trainer_time:
                return
            self.trainer_time = message.created_at
            if message.kind in ("weights", "weights_push", "trainer_started", "trainer_waiting"):
                self.trainer_version = int(body.get("version", self.trainer_version))
                self.trainer_offsets = {str(k): int(v) for k, v in body.get("offsets", {}).items()}
            self.finished = message.kind == "trainer_finished"
        elif message.kind.startswith("explorer_"):
            explorer = str(body.get("explorer_id", message.sender))
            if message.kind == "explorer_leave":
                self.explorers_seen.pop(explorer, None)
            else:
                self.explorers_seen[explorer] = now

    def live_explorers(self, now: float, horizon_s: float) -> int:
        return sum(1 for seen in self.explorers_seen.values() if now - seen <= horizon_s)


class FleetAdmission:
    """`Admission` for one explorer (see rft/explorer/main.py): `admit(n)` returns how many of n tasks may start
    now under the formula in the module docstring. Not thread-safe: call from the explorer loop."""

    def __init__(self, cfg: Config, explorer_id: str, *, source=None, refresh_s: float = 0.5):
        self.cfg, self.explorer_id = cfg, explorer_id
        self.bound = staleness_bound(cfg.run.mode, cfg.run.max_staleness)
        self.view = FleetView()
        self.refresh_s = refresh_s
        self._last_refresh = 0.0
        self._source = source or self._open_source()
        self._experience_ends: dict[str, int] = {}
        self._admitted_unseen = 0  # admitted since the experiences topic's end was last read
        self.explorer_version = 0

    def set_version(self, version: int) -> None:
        """Called by the explorer after it loaded weights `version`."""
        self.explorer_version = version

    def admit(self, n: int) -> int:
        if self.bound is None:
            return n
        self._refresh()
        now = time.time()
        explorers = max(1, self.view.live_explorers(now, 3 * self.cfg.explorer.heartbeat_s))
        share = self.capacity() // explorers - self._admitted_unseen
        admitted = max(0, min(n, share))
        self._admitted_unseen += admitted
        return admitted

    def capacity(self) -> int:
        """Groups the whole fleet may still start (see the module docstring)."""
        b = self.cfg.trainer.groups_per_step
        return (self.bound + self.explorer_version + 1) * b - (self.view.trainer_version * b + self.backlog())

    def backlog(self) -> int:
        from rft.transport import lag

        return lag(self._experience_ends, self.view.trainer_offsets)

    def _open_source(self):
        """A source on the control topic from its beginning (the view is rebuilt by replaying it)."""
        from rft.transport import RecordSource

        source = RecordSource(self.cfg.kafka, self.cfg.kafka.bootstrap_servers,
                              client_id=f"{self.explorer_id}-admission")
        source.assign([self.cfg.topic("control")])
        source.seek(source.beginning_offsets(self.cfg.topic("control")))
        return source

    def _refresh(self) -> None:
        """Read new control messages and the experiences topic's end. On a transport failure the last view
        is kept and the source is rebuilt (admission errs on the side of waiting, never of overshooting)."""
        from rft.transport import TransportError

        if time.monotonic() - self._last_refresh < self.refresh_s:
            return
        self._last_refresh = time.monotonic()
        try:
            self._read_control()
            self._experience_ends = self._source.end_offsets(self.cfg.topic("experiences"))
            self._admitted_unseen = 0  # the explorer produces synchronously: what it admitted is in the topic now
        except TransportError as e:
            log.warning("admission: %s; reconnecting", e)
            old, self._source = self._source, self._open_source()
            try:
                old.close()
            except Exception:
                pass

    def _read_control(self) -> None:
        now = time.time()
        for m in self._source.poll(timeout_s=0, max_records=10_000):
            if m.topic != self.cfg.topic("control"):
                continue
            try:
                message = decode(m.value, m.headers)
            except RecordError:
                continue
            if isinstance(message, ControlMessage):
                self.view.apply(message, now)

    def close(self) -> None:
        self._source.close()


def fleet_admission(cfg: Config, explorer_id: str) -> FleetAdmission:
    """Factory for `explorer.admission: staleness`."""
    return FleetAdmission(cfg, explorer_id)


# --------------------------------------------------------------------------------------------------
# Weight delivery (trainer side)


class WeightCoordinator:
    """The trainer's publishing rank's delivery of each version (module docstring: pull and push contracts).
    `announce(kind, body)` sends a control message; `store` is the run's WeightStore."""

    ANNOUNCE_EVERY_S = 2.0

    def __init__(self, cfg: Config, store, announce: Callable[[str, dict], None]):
        self.cfg, self.store, self.announce = cfg, store, announce
        self.method = cfg.sync.method
        self.sender = None
        if self.method == "push":
            from rft.weight_push import PushSender

            e = cfg.explorer
            self.sender = PushSender.host(host=cfg.sync.push_host or _this_host(), port=cfg.sync.push_port,
                                          world_size=1 + e.replicas * e.tensor_parallel_size,
                                          group_id=uuid.uuid4().hex[:12], timeout_s=cfg.sync.timeout_s)
        self._connected = False

    def deliver(self, version: int, buckets: Iterable[dict], offsets: dict[str, int]) -> bool:
        """Deliver `version`. False when a push failed: the caller gathers the buckets again and calls again,
        which then takes the pull path."""
        if self.method == "push":
            return self._push(version, buckets, offsets)
        path = self.store.publish(version, buckets, hf_dir=self.cfg.model.path)
        self.announce("weights", {"version": version, "path": str(path), "offsets": offsets})
        return True

    def _push(self, version: int, buckets: Iterable[dict], offsets: dict[str, int]) -> bool:
        from rft.weight_push import PushError

        try:
            if not self._connected:
                self._form_group()
            self.announce("weights_push", {"group_id": self.sender.spec.group_id, "version": version,
                                           "offsets": offsets})
            started = time.monotonic()
            sent = self.sender.send(version, buckets)
            log.info("pushed version %d (%.1f MB) in %.2f s", version, sent / 1e6, time.monotonic() - started)
            return True
        except PushError as e:
            log.warning("weight push failed, switching to the pull path for the rest of the run: %s", e)
            self.announce("push_abandoned", {"group_id": self.sender.spec.group_id, "version": version,
                                             "reason": str(e)[:500]})
            self.sender.close()
            self.method, self.sender = "pull", None
            return False

    def _form_group(self) -> None:
        from rft.weight_push import PushError

        spec, members = self.sender.spec, self.sender.spec.world_size - 1
        deadline = time.monotonic() + spec.timeout_s
        while (joined := self.sender.members_joined()) < members:
            if time.monotonic() > deadline:
                raise PushError(f"only {joined} of {members} explorer engine workers joined the push group within "
                                f"sync.timeout_s={spec.timeout_s:g}")
            self.announce("push_group", spec.to_json())
            time.sleep(self.ANNOUNCE_EVERY_S)
        try:
            self.sender.connect()
        except RuntimeError as e:
            raise PushError(f"connecting the push group: {e}") from e
        self._connected = True
        log.info("push group %s formed with %d explorer engine workers", spec.group_id, members)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


def _this_host() -> str:
    """An address of this host that explorers on other hosts can reach (sync.push_host overrides it)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
