"""The trainer side of weight synchronisation: `WeightPublisher` delivers each version by the pull or the push
path, in the order the package docstring (rft/weights/__init__.py) states."""
from __future__ import annotations

import logging
import socket
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
    is the push group's rank 0 (default: one hosted here for `push_members` explorer engine workers)."""

    ANNOUNCE_EVERY_S = 2.0

    def __init__(self, sync: "SyncConfig", *, store: "WeightStore", announce: Callable[[Kind], None],
                 hf_dir: str | None, push_members: int = 0, sender: Sender | None = None):
        self.store, self.announce, self.hf_dir = store, announce, hf_dir
        self.method = sync.method
        self.sender = sender
        if self.method == "push" and sender is None:
            self.sender = PushSender.host(host=sync.push_host or _this_host(), port=sync.push_port,
                                          world_size=1 + push_members, group_id=uuid.uuid4().hex[:12],
                                          timeout_s=sync.timeout_s)
        self._connected = False

    def deliver(self, version: int, buckets: Iterable[dict], offsets: dict[str, int]) -> bool:
        """Deliver `version`; returns when it is delivered (pull: stored and announced; push: every member acked).
        False when a push failed: the caller gathers the buckets again and calls again, which then takes the
        pull path."""
        if self.method == "push":
            return self._push(version, buckets, offsets)
        path = self.store.publish(version, buckets, hf_dir=self.hf_dir)
        self.announce(Weights(version=version, path=str(path), offsets=offsets))
        return True

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
        if self.sender is not None:
            self.sender.close()


def _this_host() -> str:
    """An address of this host that explorers on other hosts can reach (sync.push_host overrides it)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
