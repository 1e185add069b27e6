"""The trainer side of weight synchronisation: `WeightPublisher` delivers each version by the pull or the push
path, in the order the package docstring (rft/weights/__init__.py) states."""
from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

from rft.control import Kind, PushAbandoned, Weights, WeightsPush
from rft.weights.push import PushError, PushGroupSpec, PushSender

if TYPE_CHECKING:
    from rft.config import SyncConfig
    from rft.weights.store import WeightStore

log = logging.getLogger(__name__)


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
    is the push group's rank 0 (default: one hosted here for `push_members` explorer engine workers).

    Write-behind (pull path, `sync.write_behind`): `deliver` copies the buckets to host memory and returns; one
    background thread writes that version to the store and announces it while the trainer goes on with its next
    step. At most one version is in flight: the next `deliver` (and `flush`) first waits for it, and raises its
    error if the write or the announcement failed. Versions are still stored and announced in order, each one
    complete before its announcement (the package's ordering contract). The trainer calls `flush` before it commits
    a checkpoint, so a resumed trainer never waits for a version that a crash kept from being published. Host
    memory: up to two versions (one being written, one being copied)."""

    ANNOUNCE_EVERY_S = 2.0

    def __init__(self, sync: "SyncConfig", *, store: "WeightStore", announce: Callable[[Kind], None],
                 hf_dir: str | None, push_members: int = 0, sender: Sender | None = None):
        self.store, self.announce, self.hf_dir = store, announce, hf_dir
        self.method = sync.method
        self.write_behind = sync.write_behind
        self.sender = sender
        if self.method == "push" and sender is None:
            self.sender = PushSender.host(host=sync.push_host or _this_host(), port=sync.push_port,
                                          world_size=1 + push_members, group_id=uuid.uuid4().hex[:12],
                                          timeout_s=sync.timeout_s)
        self._connected = False
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None
        self.last_write_s: float | None = None  # seconds the newest finished store write + announcement took

    def deliver(self, version: int, buckets: Iterable[dict], offsets: dict[str, int]) -> bool:
        """Deliver `version`. Push: returns when every member acked; False when the push failed (the caller
        gathers the buckets again and calls again, which then takes the pull path); a failed push may leave
        `buckets` partly unread, and the caller reads the rest (the trainer's export is a collective:
        rft.trainer.main.deliver_version). Pull: returns when the
        version is stored and announced, or, with write-behind, once its tensors are copied to host memory (the
        write follows in the background, see the class docstring)."""
        if self.method == "push":
            return self._push(version, buckets, offsets)
        if not self.write_behind:
            self._store_and_announce(version, buckets, offsets)
            return True
        copies = [{name: _host_copy(t) for name, t in bucket.items()} for bucket in buckets]
        self.flush()
        self._writer = threading.Thread(target=self._write_in_background, args=(version, copies, offsets),
                                        name=f"weights-v{version}", daemon=True)
        self._writer.start()
        return True

    def flush(self) -> None:
        """Wait until the version being written in the background (if any) is stored and announced; raises
        RuntimeError if that failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._write_error is not None:
            error, self._write_error = self._write_error, None
            raise RuntimeError(f"publishing weights in the background failed: {error}") from error

    def _write_in_background(self, version: int, buckets: list[dict], offsets: dict[str, int]) -> None:
        try:
            self._store_and_announce(version, buckets, offsets)
        except BaseException as e:  # handed to the trainer's thread by flush()
            log.error("weights version %d: %s", version, e)
            self._write_error = e

    def _store_and_announce(self, version: int, buckets: Iterable[dict], offsets: dict[str, int]) -> None:
        started = time.monotonic()
        path = self.store.publish(version, buckets, hf_dir=self.hf_dir)
        self.announce(Weights(version=version, path=str(path), offsets=offsets))
        self.last_write_s = time.monotonic() - started

    def _push(self, version: int, buckets: Iterable[dict], offsets: dict[str, int]) -> bool:
        group_id = self.sender.spec.group_id
        try:
            if not self._connected:
                self._form_group()
            self.announce(WeightsPush(group_id=group_id, version=version, offsets=offsets))
            started = time.monotonic()
            sent = self.sender.send(version, buckets)
            log.info("pushed version %d (%.1f MB) in %.2f s", version, sent / 1e6, time.monotonic() - started)
            return True
        except PushError as e:
            log.warning("weight push failed, switching to the pull path for the rest of the run: %s", e)
            self.announce(PushAbandoned(group_id=group_id, version=version, reason=str(e)[:500]))
            self.sender.close()
            self.method, self.sender = "pull", None
            return False

    def _form_group(self) -> None:
        spec, members = self.sender.spec, self.sender.spec.world_size - 1
        deadline = time.monotonic() + spec.timeout_s
        while (joined := self.sender.members_joined()) < members:
            if time.monotonic() > deadline:
                raise PushError(f"only {joined} of {members} explorer engine workers joined the push group within "
                                f"sync.timeout_s={spec.timeout_s:g}")
            self.announce(spec)
            time.sleep(self.ANNOUNCE_EVERY_S)
        try:
            self.sender.connect()
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


def _host_copy(tensor):
    """A copy in host memory that the next optimizer step cannot change (a CPU parameter may be yielded as is)."""
    return tensor.detach().to("cpu", copy=True)


def _this_host() -> str:
    """An address of this host that explorers on other hosts can reach (sync.push_host overrides it)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
