"""The trainer side of weight synchronisation: `WeightPublisher` delivers each version by the pull or the push
path, in the order the package docstring (rft/weights/__init__.py) states; with pipeline parallelism, each later
stage's publishing rank writes its own share of a pull-path version through a `StagePublisher`."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from rft.transport.control import Kind, PushAbandoned, Weights, WeightsPush
from rft.weights.push import PushError, PushGroupSpec, PushSender
from rft.weights.store import pushed_adapter_bucket
from rft.weights.vllm_transfer import VLLMSender

if TYPE_CHECKING:
    from rft.weights.config import SyncConfig
    from rft.weights.store import Staging
    from rft.weights.stores import VersionStore

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"  # where the push group's store listens without sync.push_host: explorers on this host only


class Sender(Protocol):
    """The push group's rank 0 (rft.weights.push.PushSender)."""
    spec: PushGroupSpec

    def members_joined(self) -> int: ...
    def connect(self) -> None: ...
    def send(self, version: int, buckets: Iterable[dict]) -> float: ...
    def close(self) -> None: ...


class WeightPublisher:
    """Delivers each version the trainer produces (rft.weights: pull and push contracts). `announce(kind)` sends
    one control message and returns once the broker has it; `store` is the run's weight store; `hf_dir` the HF
    model directory whose config and tokenizer files go beside each version. With `sync.method: push`, `sender`
    is the push group's rank 0 (default: one hosted here for `push_members` explorer engine workers, over
    `transport`: "rft" (rft.weights.push) or "vllm" (rft.weights.vllm_transfer)).

    Write-behind (pull path, `sync.write_behind`): `deliver` copies the buckets to host memory and returns; one
    background thread writes that version to the store and announces it while the trainer goes on with its next
    step. At most one version is in flight: the next `deliver` (and `flush`) first waits for it, and raises its
    error if the write or the announcement failed. Versions are still stored and announced in order, each one
    complete before its announcement (the package's ordering contract); when the trainer awaits them is
    rft.trainer.weights.WeightSync's contract. Host memory: up to two versions (one being written, one being
    copied).

    Per-stage publishing (pull path, `staging` given to `deliver`): the buckets are the first pipeline stage's; the
    other stages' publishing ranks write theirs into the same staging directory (`StagePublisher`), and the version
    is completed, stored and announced once every stage's shards are in (WeightStore.publish; `sync.timeout_s`
    bounds the wait without progress). The push path always gets every bucket here (the push group's sender is
    this rank)."""

    ANNOUNCE_EVERY_S = 2.0

    def __init__(self, sync: SyncConfig, *, store: VersionStore, announce: Callable[[Kind], None],
                 hf_dir: str | None, push_members: int = 0, sender: Sender | None = None, transport: str = "rft"):
        self.store, self.announce, self.hf_dir = store, announce, hf_dir
        self.method = sync.method
        self.write_behind = sync.write_behind
        self.sender = sender
        if self.method == "push" and sender is None:
            host_group = VLLMSender.host if transport == "vllm" else PushSender.host  # vllm: vLLM's NCCL transfer
            self.sender = host_group(host=sync.push_host or LOOPBACK, port=sync.push_port,
                                          world_size=1 + push_members, group_id=uuid.uuid4().hex[:12],
                                          timeout_s=sync.timeout_s)
        self._connected = False
        self._background = _WriteBehind("publishing weights")
        self.stage_wait_s = sync.timeout_s
        self.last_write_s: float | None = None  # seconds the newest finished store write + announcement took
        # a LoRA run's PEFT adapter_config.json (the trainer sets it): each version is that adapter, stored
        # (WeightStore.publish) or pushed after its config (rft.weights.store.pushed_adapter_bucket), not a model
        self.adapter_config: dict | None = None

    def deliver(self, version: int, buckets: Iterable[dict], offsets: dict[str, int], *,
                staging: Staging | None = None) -> bool:
        """Deliver `version`. Push: returns when every member acked; False when the push failed (the caller
        gathers the buckets again and calls again, which then takes the pull path); a failed push may leave
        `buckets` partly unread, and the caller reads the rest (the trainer's export is a collective:
        rft.trainer.weights.deliver_version). Pull: returns when the
        version is stored and announced, or, with write-behind, once its tensors are copied to host memory (the
        write follows in the background, see the class docstring). `staging`: pull only, per-stage publishing
        (the class docstring)."""
        if self.method == "push":
            return self._push(version, buckets, offsets)
        if not self.write_behind:  # a store that keeps a delta base keeps copies the next step cannot change
            self._store_and_announce(version, _host_copies(buckets) if self.store.delta else buckets, offsets, staging)
            return True
        self._background.submit(f"weights-v{version}", self._store_and_announce,
                                version, _host_copies(buckets), offsets, staging)
        return True

    def flush(self) -> None:
        """Wait until the version being written in the background (if any) is stored and announced; raises
        RuntimeError if that failed."""
        self._background.flush()

    def _store_and_announce(self, version: int, buckets: Iterable[dict], offsets: dict[str, int],
                            staging: Staging | None = None) -> None:
        started = time.monotonic()
        path = self.store.publish(version, buckets, hf_dir=self.hf_dir, staging=staging, wait_s=self.stage_wait_s,
                                  adapter_config=self.adapter_config)
        lineage = self.store.pin.lineage  # the one the version was stamped with (claimed, or ensured by publish)
        self.announce(Weights(version=version, path=str(path), offsets=offsets, lineage=lineage.id if lineage else ""))
        self.last_write_s = time.monotonic() - started

    def _push(self, version: int, buckets: Iterable[dict], offsets: dict[str, int]) -> bool:
        sender = self._sender()
        group_id = sender.spec.group_id
        try:
            if not self._connected:
                self._form_group()
            self.announce(WeightsPush(group_id=group_id, version=version, offsets=offsets))
            started = time.monotonic()
            if self.adapter_config is not None:  # self-describing: the receiver writes the PEFT directory
                buckets = itertools.chain([pushed_adapter_bucket(self.adapter_config)], buckets)
            sent = sender.send(version, buckets)
            log.info("pushed version %d (%.1f MB) in %.2f s", version, sent / 1e6, time.monotonic() - started)
            return True
        except PushError as e:
            log.warning("weight push failed, switching to the pull path for the rest of the run: %s", e)
            self.announce(PushAbandoned(group_id=group_id, version=version, reason=str(e)[:500]))
            sender.close()
            self.method, self.sender = "pull", None
            return False

    def _sender(self) -> Sender:
        """The push group's rank 0: there is one while the method is push (dropped with the switch to pull)."""
        assert self.sender is not None, "push without a sender"
        return self.sender

    def _form_group(self) -> None:
        sender = self._sender()
        spec, members = sender.spec, sender.spec.world_size - 1
        deadline = time.monotonic() + spec.timeout_s
        lineage = self.store.pin.lineage  # claimed by the trainer before its first version
        announced = dataclasses.replace(spec, lineage=lineage.id if lineage else "")
        while (joined := sender.members_joined()) < members:
            if time.monotonic() > deadline:
                raise PushError(f"only {joined} of {members} explorer engine workers joined the push group within "
                                f"sync.timeout_s={spec.timeout_s:g}")
            self.announce(announced)
            time.sleep(self.ANNOUNCE_EVERY_S)
        try:
            sender.connect()
        except RuntimeError as e:
            raise PushError(f"connecting the push group: {e}") from e
        self._connected = True
        log.info("push group %s formed with %d explorer engine workers", spec.group_id, members)

    def close(self) -> None:
        """Finish the background write (its failure is logged, not raised: close runs on error paths too)."""
        try:
            self.flush()
        except RuntimeError as e:
            log.error("%s", e)
        if self.sender is not None:
            self.sender.close()


class StagePublisher:
    """A later pipeline stage's publishing rank (TP rank 0, DP rank 0 of stage k > 0) in per-stage publishing on the
    pull path: `deliver` writes this stage's buckets into the version's staging directory (WeightStore.write_stage);
    the publishing rank (global rank 0, a `WeightPublisher`) completes, stores and announces the version. No
    torch.distributed calls here. Write-behind as `WeightPublisher`'s (`sync.write_behind`: host copies, one
    version in flight, its failure raised by the next `deliver` or `flush`; host memory: this stage's share of up
    to two versions); the publishing rank also learns of a failure, from the `.stage-KK.failed` marker."""

    def __init__(self, sync: SyncConfig, *, store: VersionStore, stage: int):
        self.store, self.stage, self.write_behind = store, stage, sync.write_behind
        self._background = _WriteBehind(f"writing pipeline stage {stage}'s weights")

    def deliver(self, staging: Staging, buckets: Iterable[dict]) -> None:
        """Write (or, with write-behind, copy and start writing) this stage's share of `staging.version`."""
        if not self.write_behind:
            self.store.write_stage(staging, self.stage, _host_copies(buckets) if self.store.delta else buckets)
            return
        self._background.submit(f"weights-v{staging.version}-stage{self.stage}", self.store.write_stage,
                                staging, self.stage, _host_copies(buckets))

    def flush(self) -> None:
        """Wait for the background write (if any); RuntimeError if it failed."""
        self._background.flush()

    def close(self) -> None:
        """Finish the background write (its failure is logged, not raised: close runs on error paths too)."""
        try:
            self.flush()
        except RuntimeError as e:
            log.error("%s", e)


class _WriteBehind:
    """At most one write in flight on a background thread. `submit` waits for the previous one first and raises
    its error; `flush` waits and raises (each failure once), as RuntimeError("<what> in the background failed")."""

    def __init__(self, what: str):
        self.what = what
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, name: str, write: Callable, *args) -> None:
        self.flush()
        self._thread = threading.Thread(target=self._run, args=(write, args), name=name, daemon=True)
        self._thread.start()

    def _run(self, write: Callable, args: tuple) -> None:
        try:
            write(*args)
        except BaseException as e:  # handed to the trainer's thread by flush()
            log.error("%s (%s): %s", self.what, threading.current_thread().name, e)
            self._error = e

    def flush(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"{self.what} in the background failed: {error}") from error


def _host_copies(buckets: Iterable[dict]) -> list[dict]:
    return [{name: _host_copy(t) for name, t in bucket.items()} for bucket in buckets]


def _host_copy(tensor):
    """A copy in host memory that the next optimizer step cannot change (a CPU parameter may be yielded as is)."""
    return tensor.detach().to("cpu", copy=True)
